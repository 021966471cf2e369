// CUDA kernels of the ZFP fixed-rate ops. The block math is zpp/zfp_math.h, the code the CPU kernels
// run and tests/test_zfp.py checks against zfpy, so both devices write the same bits.
//
// Mapping (simple, not tuned; it has not run on a GPU yet): encoding gives each thread one chunk, the
// fewest consecutive blocks that fill whole 64-bit words (zfp::chunk_blocks: 1 block at 3-D rate >= 1,
// 4 at 1-D rate 4), so threads never share a word; decoding gives each thread one block, read at
// its bit offset. A block's values, coefficients and scratch (64 x 12 bytes in 3-D) live in local
// memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "zpp/cuda_float_io.cuh"
#include "zpp/zfp_cuda_launchers.h"
#include "zpp/zfp_math.h"

namespace zpp {
namespace cuda {
namespace {

using namespace zpp::zfp;

constexpr int kThreads = 128;

template <int dims, typename T>
__global__ void zfp_encode_kernel(const T* __restrict__ x, int64_t numel, int maxbits, uint8_t* __restrict__ payload) {
  constexpr int bv = 1 << (2 * dims);
  const int64_t nb = num_blocks(numel, dims);
  const int64_t per_chunk = chunk_blocks(maxbits);
  const int64_t chunks = (nb + per_chunk - 1) / per_chunk;
  float f[bv];
  int32_t iblock[bv];
  uint32_t u[bv];
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < chunks; c += int64_t(gridDim.x) * blockDim.x) {
    WordWriter w(payload + c * per_chunk * maxbits / 8);
    const int64_t b1 = min((c + 1) * per_chunk, nb);
    for (int64_t b = c * per_chunk; b < b1; ++b) {
      const int64_t e0 = b * bv;
      const int v = static_cast<int>(min(int64_t(bv), numel - e0));
      for (int i = 0; i < v; ++i) f[i] = load_f32(x, e0 + i);
      if (v < bv) pad_partial_block(f, v, dims);
      encode_block<BlockOpsScalar>(f, dims, maxbits, w, iblock, u);
    }
    w.flush();
  }
}

template <int dims, typename T>
__global__ void zfp_decode_kernel(const uint8_t* __restrict__ payload, int64_t numel, int maxbits, T* __restrict__ out) {
  constexpr int bv = 1 << (2 * dims);
  const int64_t nb = num_blocks(numel, dims);
  const int64_t words = payload_words(numel, dims, maxbits);
  float f[bv];
  int32_t iblock[bv];
  uint32_t u[bv];
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < nb; b += int64_t(gridDim.x) * blockDim.x) {
    BitReader in{payload, words, b * maxbits};
    decode_block<BlockOpsScalar>(in, dims, maxbits, f, iblock, u);
    const int64_t e0 = b * bv;
    const int v = static_cast<int>(min(int64_t(bv), numel - e0));
    for (int i = 0; i < v; ++i) store_f32(out, e0 + i, f[i]);
  }
}

int grid_for(int64_t items) {
  const int64_t g = (items + kThreads - 1) / kThreads;
  return static_cast<int>(g < (1 << 30) ? g : (1 << 30));  // grid-stride loops cover the rest
}

template <typename F>
void dispatch(FloatType type, int dims, F&& launch) {
  auto by_dims = [&](auto* tag) {
    switch (dims) {
      case 1: launch(tag, std::integral_constant<int, 1>{}); break;
      case 2: launch(tag, std::integral_constant<int, 2>{}); break;
      default: launch(tag, std::integral_constant<int, 3>{}); break;
    }
  };
  switch (type) {
    case FloatType::kFloat32: by_dims(static_cast<float*>(nullptr)); break;
    case FloatType::kBFloat16: by_dims(static_cast<__nv_bfloat16*>(nullptr)); break;
    case FloatType::kFloat16: by_dims(static_cast<__half*>(nullptr)); break;
  }
}

}  // namespace

void launch_zfp_encode(const void* x, FloatType type, int64_t numel, int dims, int maxbits, uint8_t* payload,
                       cudaStream_t stream) {
  if (numel == 0) return;
  const int64_t chunks = (num_blocks(numel, dims) + chunk_blocks(maxbits) - 1) / chunk_blocks(maxbits);
  dispatch(type, dims, [&](auto* tag, auto d) {
    using T = std::remove_pointer_t<decltype(tag)>;
    zfp_encode_kernel<decltype(d)::value, T>
        <<<grid_for(chunks), kThreads, 0, stream>>>(static_cast<const T*>(x), numel, maxbits, payload);
  });
}

void launch_zfp_decode(const uint8_t* payload, void* out, FloatType type, int64_t numel, int dims, int maxbits,
                       cudaStream_t stream) {
  if (numel == 0) return;
  dispatch(type, dims, [&](auto* tag, auto d) {
    using T = std::remove_pointer_t<decltype(tag)>;
    zfp_decode_kernel<decltype(d)::value, T>
        <<<grid_for(num_blocks(numel, dims)), kThreads, 0, stream>>>(payload, numel, maxbits, static_cast<T*>(out));
  });
}

}  // namespace cuda
}  // namespace zpp
