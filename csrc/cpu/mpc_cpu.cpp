// CPU kernels of the MPC ops and the container checksum (C++, at::parallel_for over
// sub-chunks). Bytes defined by zpp/mpc_math.h; checked against
// megatron_zpp/compression/mpc_reference.py in tests/test_lossless.py.
//
// Encode is two passes because a sub-chunk's place in the payload depends on how
// many non-zero words the sub-chunks before it have: pass 1 writes each
// sub-chunk's bitmap words (their place is fixed) and its e words to a scratch
// buffer and counts the non-zeros; an exclusive scan of the counts gives each
// sub-chunk's offset; pass 2 copies the non-zeros there. Decode finds the same
// offsets from the bitmap's popcounts, so it needs no size table per sub-chunk.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "zpp/mpc_math.h"

namespace zpp {
namespace {

using namespace zpp::mpc;

int dtype_code_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kFloat32;
    case at::kBFloat16: return kBFloat16;
    default: return kFloat16;
  }
}

void check_mpc_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              "megatron_zpp::mpc: ", name, " has dtype ", t.scalar_type(), "; valid: float32, bfloat16, float16");
  TORCH_CHECK(t.is_contiguous(), "megatron_zpp::mpc: ", name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), "megatron_zpp::mpc: ", name, " must be a CPU tensor here");
}

void check_dim(int64_t dim) {
  TORCH_CHECK(dim >= 1 && dim <= 32, "megatron_zpp::mpc: dim=", dim, " is not valid; valid: 1..32");
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;  // little-endian hosts only (x86-64, aarch64)
}

// ZPP-sum32 over the first `length` bytes of p (see container.py / mpc_math.h).
uint32_t checksum_bytes(const uint8_t* p, int64_t length) {
  const int64_t words = div_up(length, 4);
  const int64_t full = length / 4;
  uint32_t head = 0;
  const int64_t first_fast = std::min<int64_t>(kChecksumWord + 1, full);
  for (int64_t i = 0; i < first_fast; ++i) head += checksum_term(checksum_word(p, length, i), i);
  for (int64_t i = std::max(first_fast, full); i < words; ++i) head += checksum_term(checksum_word(p, length, i), i);
  if (full <= first_fast) return head;
  const uint32_t body = at::parallel_reduce(
      first_fast, full, int64_t{1} << 16, uint32_t{0},
      [&](int64_t begin, int64_t end, uint32_t acc) {
        for (int64_t i = begin; i < end; ++i) acc += checksum_term(load_u32(p + 4 * i), i);
        return acc;
      },
      [](uint32_t a, uint32_t b) { return a + b; });
  return head + body;
}

at::Tensor container_checksum_cpu(const at::Tensor& payload) {
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.dim() == 1 && payload.is_contiguous(),
              "megatron_zpp::container_checksum: payload must be a contiguous 1-D uint8 tensor");
  const uint8_t* p = payload.data_ptr<uint8_t>();
  const int64_t length = checksum_length(p, payload.numel());
  return at::scalar_tensor(static_cast<int64_t>(checksum_bytes(p, length)), payload.options().dtype(at::kLong));
}

// Raw words of value j of the tensor as uint32 (16-bit values zero-extended).
template <int kBits>
inline uint32_t load_word(const void* x, int64_t j) {
  if constexpr (kBits == 32) return static_cast<const uint32_t*>(x)[j];
  else return static_cast<const uint16_t*>(x)[j];
}

template <int kBits>
inline void store_word(void* out, int64_t j, uint32_t v) {
  if constexpr (kBits == 32) static_cast<uint32_t*>(out)[j] = v;
  else static_cast<uint16_t*>(out)[j] = static_cast<uint16_t>(v);
}

// Pass 1 for sub-chunk k: e words -> scratch, bitmap words -> bitmap, returns the non-zero count.
template <int kBits>
int64_t encode_subchunk(const void* x, int64_t n, int64_t k, int dim, uint32_t* scratch, uint32_t* bitmap) {
  const int64_t start = k * kSubchunk;
  const int m = static_cast<int>(std::min<int64_t>(kSubchunk, n - start));
  const int groups = static_cast<int>(div_up(m, kGroup));
  uint32_t w[kSubchunk];
  for (int j = 0; j < m; ++j) w[j] = load_word<kBits>(x, start + j);
  uint32_t* e = scratch + k * subchunk_plane_words(kBits);
  uint32_t prev = 0;
  for (int g = 0; g < groups; ++g) {
    uint32_t a[32];
    for (int i = 0; i < 32; ++i) a[i] = lnvd_residual(w, 32 * g + i, m, dim, kBits);
    transpose32(a);
    for (int L = 0; L < kBits; ++L) {  // LNV1 over the plane words, in (group, plane) order
      e[kBits * g + L] = a[L] - prev;
      prev = a[L];
    }
  }
  const int planes = kBits * groups;
  uint32_t* bm = bitmap + k * (subchunk_plane_words(kBits) / 32);
  int64_t count = 0;
  for (int b0 = 0; b0 < planes; b0 += 32) {
    uint32_t word = 0;
    for (int b = 0; b < 32 && b0 + b < planes; ++b) word |= static_cast<uint32_t>(e[b0 + b] != 0) << b;
    bm[b0 / 32] = word;
    count += __builtin_popcount(word);
  }
  return count;
}

template <int kBits>
at::Tensor mpc_encode_impl(const at::Tensor& x, int dim) {
  const int64_t n = x.numel();
  const int64_t k_total = num_subchunks(n);
  const int64_t nbitmap = bitmap_words(n, kBits);
  at::Tensor out = at::empty({max_payload_bytes(n, kBits)}, x.options().dtype(at::kByte));
  uint8_t* p = out.data_ptr<uint8_t>();
  auto* bitmap = reinterpret_cast<uint32_t*>(p + kMpcBodyOffset);
  uint32_t* nonzero = bitmap + nbitmap;
  // e words of every sub-chunk (uninitialised: pass 1 writes each word pass 2 reads).
  at::Tensor scratch_t = at::empty({k_total * subchunk_plane_words(kBits)}, x.options().dtype(at::kInt));
  auto* scratch = reinterpret_cast<uint32_t*>(scratch_t.data_ptr<int32_t>());
  std::vector<int64_t> offsets(k_total + 1, 0);
  const void* xp = x.data_ptr();
  at::parallel_for(0, k_total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) offsets[k + 1] = encode_subchunk<kBits>(xp, n, k, dim, scratch, bitmap);
  });
  for (int64_t k = 0; k < k_total; ++k) offsets[k + 1] += offsets[k];
  at::parallel_for(0, k_total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t planes = plane_words(std::min<int64_t>(kSubchunk, n - k * kSubchunk), kBits);
      const uint32_t* e = scratch + k * subchunk_plane_words(kBits);
      uint32_t* dst = nonzero + offsets[k];
      for (int64_t j = 0; j < planes; ++j)
        if (e[j] != 0) *dst++ = e[j];
    }
  });
  const int64_t nonzero_bytes = 4 * offsets[k_total];
  write_mpc_header(p, dtype_code_of(x), dim, n, 4 * nbitmap, nonzero_bytes);
  const int64_t length = kMpcBodyOffset + 4 * nbitmap + nonzero_bytes;
  store_u32(p + 4 * kChecksumWord, checksum_bytes(p, length));
  return out.narrow(0, 0, length);
}

at::Tensor mpc_encode_cpu(const at::Tensor& x, int64_t dim) {
  check_mpc_float(x, "x");
  check_dim(dim);
  return x.scalar_type() == at::kFloat ? mpc_encode_impl<32>(x, static_cast<int>(dim))
                                       : mpc_encode_impl<16>(x, static_cast<int>(dim));
}

template <int kBits>
void mpc_decode_impl(const uint8_t* p, int64_t payload_bytes, void* out, int64_t n, int dim) {
  const int64_t k_total = num_subchunks(n);
  const int64_t nbitmap = bitmap_words(n, kBits);
  const uint32_t bitmap_bytes = load_u32(p + kHeaderBytes), nonzero_bytes = load_u32(p + kHeaderBytes + 4);
  TORCH_CHECK(bitmap_bytes == 4 * nbitmap, "megatron_zpp::mpc: payload is corrupt: its bitmap has ", bitmap_bytes,
              " bytes, ", n, " values need ", 4 * nbitmap);
  TORCH_CHECK(nonzero_bytes % 4 == 0 && kMpcBodyOffset + int64_t{bitmap_bytes} + nonzero_bytes <= payload_bytes,
              "megatron_zpp::mpc: payload is corrupt or truncated: body of ", bitmap_bytes, " + ", nonzero_bytes,
              " bytes in a ", payload_bytes, "-byte buffer");
  std::vector<uint32_t> bitmap(nbitmap);
  std::memcpy(bitmap.data(), p + kMpcBodyOffset, 4 * nbitmap);
  const uint8_t* nonzero = p + kMpcBodyOffset + 4 * nbitmap;
  const int per_sub = subchunk_plane_words(kBits) / 32;  // bitmap words per full sub-chunk
  std::vector<int64_t> offsets(k_total + 1, 0);
  for (int64_t k = 0; k < k_total; ++k) {
    int64_t c = 0;
    const int64_t end = std::min<int64_t>((k + 1) * per_sub, nbitmap);
    for (int64_t b = k * per_sub; b < end; ++b) c += __builtin_popcount(bitmap[b]);
    offsets[k + 1] = offsets[k] + c;
  }
  TORCH_CHECK(4 * offsets[k_total] == nonzero_bytes, "megatron_zpp::mpc: payload is corrupt: its bitmap marks ",
              offsets[k_total], " non-zero words, its body holds ", nonzero_bytes / 4);
  at::parallel_for(0, k_total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t start = k * kSubchunk;
      const int m = static_cast<int>(std::min<int64_t>(kSubchunk, n - start));
      const int groups = static_cast<int>(div_up(m, kGroup));
      const uint32_t* bm = bitmap.data() + k * per_sub;
      int64_t at_word = offsets[k];
      uint32_t q = 0;
      uint32_t w[kSubchunk];
      for (int g = 0; g < groups; ++g) {
        uint32_t a[32] = {0};
        for (int L = 0; L < kBits; ++L) {
          const int j = kBits * g + L;
          if ((bm[j / 32] >> (j % 32)) & 1u) q += load_u32(nonzero + 4 * at_word++);  // undo LNV1
          a[L] = q;
        }
        transpose32(a);
        for (int i = 0; i < 32; ++i) {  // undo LNVd
          const int j = 32 * g + i;
          if (j >= m) break;
          w[j] = (j < dim ? a[i] : a[i] + w[j - dim]) & word_mask(kBits);
          store_word<kBits>(out, start + j, w[j]);
        }
      }
    }
  });
}

void mpc_decode_cpu(const at::Tensor& payload, const at::Tensor& out, int64_t dim) {
  check_mpc_float(out, "out");
  check_dim(dim);
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.dim() == 1 && payload.is_contiguous(),
              "megatron_zpp::mpc: payload must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(payload.device().is_cpu(), "megatron_zpp::mpc: payload must be a CPU tensor here");
  TORCH_CHECK(payload.numel() >= kMpcBodyOffset, "megatron_zpp::mpc: payload is truncated: ", payload.numel(),
              " bytes, the header and sizes alone are ", kMpcBodyOffset);
  const uint8_t* p = payload.data_ptr<uint8_t>();
  TORCH_CHECK(load_u64(p + 8) == static_cast<uint64_t>(out.numel()), "megatron_zpp::mpc: payload holds ",
              load_u64(p + 8), " elements, out has ", out.numel());
  if (out.scalar_type() == at::kFloat) mpc_decode_impl<32>(p, payload.numel(), out.data_ptr(), out.numel(), dim);
  else mpc_decode_impl<16>(p, payload.numel(), out.data_ptr(), out.numel(), dim);
}

}  // namespace
}  // namespace zpp

TORCH_LIBRARY_IMPL(megatron_zpp, CPU, m) {
  m.impl("mpc_encode", &zpp::mpc_encode_cpu);
  m.impl("mpc_decode_", &zpp::mpc_decode_cpu);
  m.impl("container_checksum", &zpp::container_checksum_cpu);
}
