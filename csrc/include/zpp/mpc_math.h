// MPC (lossless) and container math shared by the C++ (CPU) and CUDA kernels.
//
// Everything that decides which bytes an MPC payload holds lives here: the
// container header layout, the ZPP-sum32 checksum, the sub-chunk geometry and
// the per-word prediction rules. The pure-PyTorch reference
// (megatron_zpp/compression/mpc_reference.py, container.py) implements the
// same rules and is the test oracle; format: megatron_zpp/compression/lossless.md.
//
// Stages per sub-chunk of kSubchunk values, B = 32 (float32) or 16 (bf16/fp16):
//   LNVd  d[j] = w[j] - w[j-dim] (mod 2^B) for dim <= j < m, w[j] for j < dim, 0 for j >= m
//   BIT   plane L (< B) of group g: bit i = bit L of d[32g+i]           (transpose32)
//   LNV1  e[0] = q[0], e[j] = q[j] - q[j-1] (mod 2^32) over the plane words
//   ZE    bitmap bit b of word m = (e[32m+b] != 0); then the non-zero e in order
#pragma once

#include <stdint.h>

#include "zpp/quant_math.h"

#if defined(__CUDACC__)
#define ZPP_MPC_HD __host__ __device__ __forceinline__
#else
#define ZPP_MPC_HD inline
#endif

namespace zpp {
namespace mpc {

// ------------------------------------------------------------ container ----
constexpr uint32_t kMagic = 0x4350505au;  // "ZPPC" read as a little-endian uint32
constexpr int kVersion = 1;
constexpr int kHeaderBytes = 32;
constexpr int kChecksumWord = 7;            // bytes 28..31
constexpr uint32_t kGolden = 0x9e3779b9u;   // index key multiplier of the checksum
constexpr int kCodecMpc = 1;
constexpr int kMpcSizes = 2;                // sizes table: [bitmap bytes, non-zero bytes]
constexpr int kMpcBodyOffset = kHeaderBytes + 4 * kMpcSizes;

enum DtypeCode : int { kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

using zpp::mix32;  // the bijective hash of quant_math.h (lowbias32), one definition for both codecs

// One word's term of ZPP-sum32: the checksum is the sum (mod 2^32) of these over the payload's
// words, word kChecksumWord read as 0. Bijective in w, keyed by the word index.
ZPP_MPC_HD uint32_t checksum_term(uint32_t w, uint64_t index) {
  return mix32(w ^ (static_cast<uint32_t>(index) * kGolden));
}

// Word `index` of a payload of `length` bytes, zero-padded past the end, the checksum field as 0.
ZPP_MPC_HD uint32_t checksum_word(const uint8_t* p, int64_t length, int64_t index) {
  if (index == kChecksumWord) return 0;
  const int64_t at = 4 * index;
  uint32_t w = 0;
  for (int b = 0; b < 4; ++b)
    if (at + b < length) w |= static_cast<uint32_t>(p[at + b]) << (8 * b);
  return w;
}

ZPP_MPC_HD uint64_t load_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int b = 0; b < 8; ++b) v |= static_cast<uint64_t>(p[b]) << (8 * b);
  return v;
}

ZPP_MPC_HD void store_u32(uint8_t* p, uint32_t v) {
  for (int b = 0; b < 4; ++b) p[b] = static_cast<uint8_t>(v >> (8 * b));
}

ZPP_MPC_HD void store_u64(uint8_t* p, uint64_t v) {
  for (int b = 0; b < 8; ++b) p[b] = static_cast<uint8_t>(v >> (8 * b));
}

// The bytes the checksum covers: the header's payload-bytes field, clamped to the buffer.
ZPP_MPC_HD int64_t checksum_length(const uint8_t* p, int64_t buffer_bytes) {
  if (buffer_bytes < kHeaderBytes) return buffer_bytes;
  const uint64_t field = load_u64(p + 16);
  return field > static_cast<uint64_t>(buffer_bytes) ? buffer_bytes : static_cast<int64_t>(field);
}

// Header + sizes table of an MPC payload (checksum field 0; filled in last).
ZPP_MPC_HD void write_mpc_header(uint8_t* p, int dtype_code, int dim, int64_t numel, int64_t bitmap_bytes,
                                 int64_t nonzero_bytes) {
  store_u32(p, kMagic);
  p[4] = kVersion;
  p[5] = kCodecMpc;
  p[6] = static_cast<uint8_t>(dtype_code);
  p[7] = static_cast<uint8_t>(dim);
  store_u64(p + 8, static_cast<uint64_t>(numel));
  store_u64(p + 16, static_cast<uint64_t>(kMpcBodyOffset + bitmap_bytes + nonzero_bytes));
  store_u32(p + 24, kMpcSizes);
  store_u32(p + 28, 0);
  store_u32(p + 32, static_cast<uint32_t>(bitmap_bytes));
  store_u32(p + 36, static_cast<uint32_t>(nonzero_bytes));
}

// ------------------------------------------------------------- geometry ----
constexpr int kSubchunk = 1024;  // values per sub-chunk; all prediction stays inside one
constexpr int kGroup = 32;       // values per bit-transpose group

ZPP_MPC_HD int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }
ZPP_MPC_HD int64_t num_subchunks(int64_t numel) { return div_up(numel, kSubchunk); }
// Plane words (e words) of the whole tensor, and of one full sub-chunk.
ZPP_MPC_HD int64_t plane_words(int64_t numel, int bits) { return bits * div_up(numel, kGroup); }
ZPP_MPC_HD int subchunk_plane_words(int bits) { return bits * (kSubchunk / kGroup); }
ZPP_MPC_HD int64_t bitmap_words(int64_t numel, int bits) { return div_up(plane_words(numel, bits), 32); }
// Worst case: every plane word non-zero.
ZPP_MPC_HD int64_t max_payload_bytes(int64_t numel, int bits) {
  return kMpcBodyOffset + 4 * bitmap_words(numel, bits) + 4 * plane_words(numel, bits);
}

// --------------------------------------------------------- word stages -----
ZPP_MPC_HD uint32_t word_mask(int bits) { return bits == 32 ? 0xffffffffu : ((1u << bits) - 1u); }

// LNVd: the residual of value j of a sub-chunk holding m values (w = that sub-chunk's words).
ZPP_MPC_HD uint32_t lnvd_residual(const uint32_t* w, int j, int m, int dim, int bits) {
  if (j >= m) return 0;
  if (j < dim) return w[j];
  return (w[j] - w[j - dim]) & word_mask(bits);
}

// One round of the transpose: swap the high J bits (under mask M) of the first half of every
// 2J-word run with the low J bits of its second half. Compile-time J and M: unrolled loops.
template <int J, uint32_t M>
ZPP_MPC_HD void transpose_round(uint32_t* a) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int base = 0; base < 32; base += 2 * J)
    for (int k = base; k < base + J; ++k) {
      const uint32_t t = ((a[k] >> J) ^ a[k + J]) & M;
      a[k] ^= t << J;
      a[k + J] ^= t;
    }
}

// 32x32 bit transpose in place: out word L bit i = in word i bit L (an involution). Five rounds of
// masked swaps between the halves of each 2j-word run.
ZPP_MPC_HD void transpose32(uint32_t* a) {
  transpose_round<16, 0x0000ffffu>(a);
  transpose_round<8, 0x00ff00ffu>(a);
  transpose_round<4, 0x0f0f0f0fu>(a);
  transpose_round<2, 0x33333333u>(a);
  transpose_round<1, 0x55555555u>(a);
}

}  // namespace mpc
}  // namespace zpp
