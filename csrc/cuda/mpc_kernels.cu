// CUDA kernels of MPC / MPC16 and the container checksum. Same bytes as the CPU kernels
// (csrc/cpu/mpc_cpu.cpp): the header layout, the checksum terms, the sub-chunk geometry and
// the LNVd residual come from zpp/mpc_math.h. NOT RUN: compiled for sm_80/sm_90 in CI, never
// executed (no GPU where it was written); tests/test_lossless.py compares it with the CPU bytes
// when a GPU is present.
//
// Mapping: one thread block of 1024 threads per 1024-value sub-chunk; warp g holds group g
// (32 values), so the 32x32 bit transpose is 32 warp ballots (__ballot_sync of bit L of every
// lane's word is plane word L) instead of mpc_math.h's swap network: the same function,
// checked against it by the tests. Encode: pass 1 (residuals, transpose, LNV1, bitmap, counts,
// e words to scratch), an exclusive scan of the counts (one block), pass 2 (compaction),
// header, checksum. Decode: popcounts per sub-chunk, scan, then per sub-chunk gather +
// inclusive scan (undo LNV1) + ballot transpose + strided scan (undo LNVd). No host syncs.
#include <cuda_runtime.h>

#include "zpp/mpc_cuda_launchers.h"
#include "zpp/mpc_math.h"

namespace zpp {
namespace cuda {
namespace {

using namespace zpp::mpc;

constexpr int kThreads = kSubchunk;  // one thread per value of a sub-chunk
constexpr unsigned kFull = 0xffffffffu;

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ uint32_t load_raw(const void* x, int64_t j, int bits) {
  return bits == 32 ? static_cast<const uint32_t*>(x)[j] : static_cast<const uint16_t*>(x)[j];
}

// Inclusive scan (mod 2^32) over s[0..kThreads) with stride `stride`: s[j] += s[j - stride*2^r].
// With stride 1 a prefix sum; with stride dim, one prefix sum per residue class (undo LNVd).
__device__ void block_scan_stride(uint32_t* s, int stride) {
  const int t = threadIdx.x;
  for (int off = stride; off < kThreads; off *= 2) {
    const uint32_t v = s[t] + (t >= off ? s[t - off] : 0u);
    __syncthreads();
    s[t] = v;
    __syncthreads();
  }
}

// ---------------------------------------------------------------- encode ----
// Pass 1: e words to scratch, bitmap words to the payload, non-zero count per sub-chunk.
template <int kBits>
__global__ void encode_pass1(const void* x, int64_t n, int dim, uint32_t* scratch, uint32_t* bitmap,
                             int64_t* counts) {
  __shared__ uint32_t w[kThreads];
  __shared__ uint32_t q[kThreads];
  __shared__ int warp_count[kThreads / 32];
  const int64_t k = blockIdx.x;
  const int64_t start = k * kSubchunk;
  const int m = static_cast<int>(min64(kSubchunk, n - start));
  const int groups = static_cast<int>(div_up(m, kGroup));
  const int planes = kBits * groups;
  const int t = threadIdx.x, lane = t & 31, g = t >> 5;
  w[t] = t < m ? load_raw(x, start + t, kBits) : 0u;
  __syncthreads();
  const uint32_t d = lnvd_residual(w, t, m, dim, kBits);
  uint32_t plane = 0;
  for (int L = 0; L < kBits; ++L) {
    const uint32_t b = __ballot_sync(kFull, (d >> L) & 1u);
    if (lane == L) plane = b;
  }
  if (lane < kBits && g < groups) q[kBits * g + lane] = plane;
  __syncthreads();
  const int p = t;  // plane word index within the sub-chunk
  uint32_t e = 0;
  if (p < planes) e = p == 0 ? q[0] : q[p] - q[p - 1];
  const bool nz = p < planes && e != 0;
  if (p < planes) scratch[k * subchunk_plane_words(kBits) + p] = e;
  const uint32_t word = __ballot_sync(kFull, nz);
  if (lane == 0) {
    if (32 * g < planes) bitmap[k * (subchunk_plane_words(kBits) / 32) + g] = word;
    warp_count[g] = __popc(word);
  }
  __syncthreads();
  if (t == 0) {
    int64_t c = 0;
    for (int i = 0; i < kThreads / 32; ++i) c += warp_count[i];
    counts[k] = c;
  }
}

// offsets[k] = sum of counts[0..k), offsets[K] = total. One block; tiles of kThreads.
__global__ void exclusive_scan(const int64_t* counts, int64_t num, int64_t* offsets) {
  __shared__ int64_t s[kThreads];
  __shared__ int64_t carry;
  const int t = threadIdx.x;
  if (t == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < num; base += kThreads) {
    const int64_t v = base + t < num ? counts[base + t] : 0;
    s[t] = v;
    __syncthreads();
    for (int off = 1; off < kThreads; off *= 2) {
      const int64_t u = s[t] + (t >= off ? s[t - off] : 0);
      __syncthreads();
      s[t] = u;
      __syncthreads();
    }
    if (base + t < num) offsets[base + t] = carry + s[t] - v;
    __syncthreads();
    if (t == 0) carry += s[kThreads - 1];
    __syncthreads();
  }
  if (t == 0) offsets[num] = carry;
}

// Pass 2: the non-zero e words of sub-chunk k to their place.
template <int kBits>
__global__ void encode_pass2(int64_t n, const uint32_t* scratch, const int64_t* offsets, uint32_t* nonzero) {
  __shared__ int warp_prefix[kThreads / 32];
  const int64_t k = blockIdx.x;
  const int m = static_cast<int>(min64(kSubchunk, n - k * kSubchunk));
  const int planes = kBits * static_cast<int>(div_up(m, kGroup));
  const int t = threadIdx.x, lane = t & 31, g = t >> 5;
  const uint32_t e = t < planes ? scratch[k * subchunk_plane_words(kBits) + t] : 0u;
  const uint32_t word = __ballot_sync(kFull, e != 0);
  if (lane == 0) warp_prefix[g] = __popc(word);
  __syncthreads();
  if (t == 0) {
    int acc = 0;
    for (int i = 0; i < kThreads / 32; ++i) {
      const int c = warp_prefix[i];
      warp_prefix[i] = acc;
      acc += c;
    }
  }
  __syncthreads();
  if (e != 0) nonzero[offsets[k] + warp_prefix[g] + __popc(word & ((1u << lane) - 1u))] = e;
}

__global__ void write_header(uint8_t* payload, int dtype_code, int dim, int64_t n, int64_t bitmap_bytes,
                             const int64_t* total, uint32_t* checksum_acc) {
  write_mpc_header(payload, dtype_code, dim, n, bitmap_bytes, 4 * *total);
  *checksum_acc = 0;
}

// ---------------------------------------------------------------- checksum --
__global__ void checksum_kernel(const uint8_t* p, int64_t buffer_bytes, bool aligned, uint32_t* acc) {
  const int64_t length = checksum_length(p, buffer_bytes);
  const int64_t words = div_up(length, 4), full = length / 4;
  uint32_t sum = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t w = (aligned && i < full && i != kChecksumWord) ? reinterpret_cast<const uint32_t*>(p)[i]
                                                                     : checksum_word(p, length, i);
    sum += checksum_term(w, i);
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(acc, sum);  // unsigned wrap-around: the sum mod 2^32
}

__global__ void store_checksum(uint8_t* payload, const uint32_t* acc) { store_u32(payload + 28, *acc); }

__global__ void checksum_to_int64(const uint32_t* acc, int64_t* out) { *out = static_cast<int64_t>(*acc); }

void launch_checksum(const uint8_t* p, int64_t buffer_bytes, uint32_t* acc, cudaStream_t stream) {
  const int threads = 256;
  const int64_t words = div_up(buffer_bytes, 4);
  const int blocks = static_cast<int>(min64(max64(div_up(words, threads), 1), 1024));
  const bool aligned = reinterpret_cast<uintptr_t>(p) % 4 == 0;
  checksum_kernel<<<blocks, threads, 0, stream>>>(p, buffer_bytes, aligned, acc);
}

// ---------------------------------------------------------------- decode ----
// One warp per sub-chunk, kCountWarps sub-chunks per CTA (a 32-thread CTA per sub-chunk would cap
// an SM at its resident-CTA limit, a quarter to a half of its threads).
constexpr int kCountWarps = 8;

template <int kBits>
__global__ void decode_counts(const uint32_t* bitmap, int64_t n, int64_t* counts) {
  const int lane = threadIdx.x & 31;
  const int64_t k = int64_t(blockIdx.x) * kCountWarps + threadIdx.x / 32;
  if (k >= num_subchunks(n)) return;  // the whole warp: no shuffle is left half-populated
  const int per_sub = subchunk_plane_words(kBits) / 32;
  const int64_t nbitmap = bitmap_words(n, kBits);
  const int64_t b = k * per_sub + lane;
  int c = (lane < per_sub && b < nbitmap) ? __popc(bitmap[b]) : 0;
  for (int off = 16; off > 0; off >>= 1) c += __shfl_xor_sync(kFull, c, off);
  if (lane == 0) counts[k] = c;
}

template <int kBits>
__global__ void decode_subchunks(const uint8_t* payload, int64_t payload_bytes, void* out, int64_t n, int dim,
                                 const int64_t* offsets) {
  __shared__ uint32_t bm[32];
  __shared__ int bm_prefix[32];
  __shared__ uint32_t s[kThreads];
  const int64_t k = blockIdx.x;
  const int64_t start = k * kSubchunk;
  const int m = static_cast<int>(min64(kSubchunk, n - start));
  const int groups = static_cast<int>(div_up(m, kGroup));
  const int planes = kBits * groups;
  const int per_sub = subchunk_plane_words(kBits) / 32;
  const int t = threadIdx.x, lane = t & 31, g = t >> 5;
  const int64_t nbitmap = bitmap_words(n, kBits);
  const uint32_t* bitmap = reinterpret_cast<const uint32_t*>(payload + kMpcBodyOffset);
  const uint8_t* nonzero = payload + kMpcBodyOffset + 4 * nbitmap;
  // Reads never pass the buffer, whatever the (validated) header claims.
  const int64_t nonzero_capacity = (payload_bytes - kMpcBodyOffset - 4 * nbitmap) / 4;
  if (t < per_sub) bm[t] = k * per_sub + t < nbitmap ? bitmap[k * per_sub + t] : 0u;
  __syncthreads();
  if (t == 0) {
    int acc = 0;
    for (int i = 0; i < per_sub; ++i) {
      bm_prefix[i] = acc;
      acc += __popc(bm[i]);
    }
  }
  __syncthreads();
  uint32_t e = 0;
  if (t < planes && ((bm[t / 32] >> (t % 32)) & 1u)) {
    const int64_t at = offsets[k] + bm_prefix[t / 32] + __popc(bm[t / 32] & ((1u << (t % 32)) - 1u));
    if (at < nonzero_capacity) {
      const uint8_t* src = nonzero + 4 * at;
      e = src[0] | (uint32_t(src[1]) << 8) | (uint32_t(src[2]) << 16) | (uint32_t(src[3]) << 24);
    }
  }
  s[t] = e;
  __syncthreads();
  block_scan_stride(s, 1);  // undo LNV1: the plane words
  const uint32_t plane = (lane < kBits && g < groups) ? s[kBits * g + lane] : 0u;
  uint32_t d = 0;
  for (int i = 0; i < 32; ++i) {  // transpose back: value i of the group gathers bit i of every plane
    const uint32_t b = __ballot_sync(kFull, (plane >> i) & 1u);
    if (lane == i) d = b;
  }
  __syncthreads();
  s[t] = d;
  __syncthreads();
  block_scan_stride(s, dim);  // undo LNVd
  if (t < m) {
    const uint32_t v = s[t] & word_mask(kBits);
    if (kBits == 32) static_cast<uint32_t*>(out)[start + t] = v;
    else static_cast<uint16_t*>(out)[start + t] = static_cast<uint16_t>(v);
  }
}

struct EncodeScratch {
  int64_t* counts;
  int64_t* offsets;
  uint32_t* acc;
  uint32_t* e;
};

EncodeScratch carve_encode(void* scratch, int64_t n, int bits) {
  const int64_t k = num_subchunks(n);
  auto* base = static_cast<int64_t*>(scratch);
  EncodeScratch s;
  s.counts = base;
  s.offsets = base + k;
  s.acc = reinterpret_cast<uint32_t*>(base + 2 * k + 1);
  s.e = s.acc + 2;
  return s;
}

}  // namespace

int64_t mpc_encode_scratch_bytes(int64_t n, int bits) {
  const int64_t k = num_subchunks(n);
  return 8 * (2 * k + 1) + 8 + 4 * k * subchunk_plane_words(bits);
}

int64_t mpc_decode_scratch_bytes(int64_t n, int bits) { return 8 * (2 * num_subchunks(n) + 1); }

void launch_mpc_encode(const void* x, int64_t n, int bits, int dtype_code, int dim, uint8_t* payload,
                       int64_t payload_capacity, void* scratch, cudaStream_t stream) {
  const unsigned k = static_cast<unsigned>(num_subchunks(n));
  const EncodeScratch s = carve_encode(scratch, n, bits);
  auto* bitmap = reinterpret_cast<uint32_t*>(payload + kMpcBodyOffset);
  uint32_t* nonzero = bitmap + bitmap_words(n, bits);
  if (k > 0) {
    if (bits == 32) encode_pass1<32><<<k, kThreads, 0, stream>>>(x, n, dim, s.e, bitmap, s.counts);
    else encode_pass1<16><<<k, kThreads, 0, stream>>>(x, n, dim, s.e, bitmap, s.counts);
  }
  exclusive_scan<<<1, kThreads, 0, stream>>>(s.counts, k, s.offsets);
  if (k > 0) {
    if (bits == 32) encode_pass2<32><<<k, kThreads, 0, stream>>>(n, s.e, s.offsets, nonzero);
    else encode_pass2<16><<<k, kThreads, 0, stream>>>(n, s.e, s.offsets, nonzero);
  }
  write_header<<<1, 1, 0, stream>>>(payload, dtype_code, dim, n, 4 * bitmap_words(n, bits), s.offsets + k, s.acc);
  launch_checksum(payload, payload_capacity, s.acc, stream);
  store_checksum<<<1, 1, 0, stream>>>(payload, s.acc);
}

void launch_mpc_decode(const uint8_t* payload, int64_t payload_bytes, void* out, int64_t n, int bits, int dim,
                       void* scratch, cudaStream_t stream) {
  const unsigned k = static_cast<unsigned>(num_subchunks(n));
  if (k == 0) return;
  auto* counts = static_cast<int64_t*>(scratch);
  int64_t* offsets = counts + k;
  const auto* bitmap = reinterpret_cast<const uint32_t*>(payload + kMpcBodyOffset);
  const unsigned count_ctas = (k + kCountWarps - 1) / kCountWarps;
  if (bits == 32) decode_counts<32><<<count_ctas, 32 * kCountWarps, 0, stream>>>(bitmap, n, counts);
  else decode_counts<16><<<count_ctas, 32 * kCountWarps, 0, stream>>>(bitmap, n, counts);
  exclusive_scan<<<1, kThreads, 0, stream>>>(counts, k, offsets);
  if (bits == 32) decode_subchunks<32><<<k, kThreads, 0, stream>>>(payload, payload_bytes, out, n, dim, offsets);
  else decode_subchunks<16><<<k, kThreads, 0, stream>>>(payload, payload_bytes, out, n, dim, offsets);
}

void launch_container_checksum(const uint8_t* payload, int64_t buffer_bytes, int64_t* out, void* scratch,
                               cudaStream_t stream) {
  auto* acc = static_cast<uint32_t*>(scratch);
  cudaMemsetAsync(acc, 0, sizeof(uint32_t), stream);
  launch_checksum(payload, buffer_bytes, acc, stream);
  checksum_to_int64<<<1, 1, 0, stream>>>(acc, out);
}

}  // namespace cuda
}  // namespace zpp
