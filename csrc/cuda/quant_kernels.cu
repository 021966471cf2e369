// CUDA kernels of the blocked INT8/INT4 ops. Same contract and the same bits
// as the CPU kernels: every rounding, index and packing decision comes from
// zpp/quant_math.h, and device float math uses its _rn helpers (no FMA).
//
// Mapping: one thread block per quantization block; each thread owns element
// *pairs* (2p, 2p+1) so an INT4 byte is written by exactly one thread. absmax
// is reduced on |x| bit patterns (as on CPU: bits >= 0x7f800000 means NaN/Inf).
// The fused dequant+reduce+quant recomputes the fp32 sum in its second pass
// instead of staging it in shared memory: blocks may be up to 64K elements, and
// the re-read of the chunk inputs is served from L2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "zpp/cuda_float_io.cuh"
#include "zpp/cuda_launchers.h"
#include "zpp/quant_math.h"

namespace zpp {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Max over the thread block; every thread gets the result.
__device__ uint32_t block_max_u32(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? warp_max[lane] : 0u;
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();  // warp_max is reused by the next call
  return v;
}

__device__ __forceinline__ float scale_from_max_bits(uint32_t m, int qmax) {
  return block_scale(__uint_as_float(m), m >= 0x7f800000u, qmax);
}

__device__ __forceinline__ int quantize_one(float x, float scale, float fq, bool stochastic, uint64_t seed,
                                            uint64_t index) {
  return stochastic ? quantize_stochastic_unchecked(x, scale, fq, stochastic_uniform(seed, index))
                    : quantize_nearest_unchecked(x, scale, fq);
}

__device__ __forceinline__ int load_q(const uint8_t* data, int64_t e, int bits) {
  if (bits == 8) return static_cast<int8_t>(data[e]);
  const uint8_t b = data[e >> 1];
  return (e & 1) ? unpack_int4_hi(b) : unpack_int4_lo(b);
}

// Writes elements (2p, 2p+1) of a block (the second only if has_hi).
__device__ __forceinline__ void store_pair(uint8_t* data, int64_t e, int bits, int q0, int q1, bool has_hi) {
  if (bits == 8) {
    data[e] = static_cast<uint8_t>(static_cast<int8_t>(q0));
    if (has_hi) data[e + 1] = static_cast<uint8_t>(static_cast<int8_t>(q1));
  } else {
    data[e >> 1] = pack_int4(q0, has_hi ? q1 : 0);
  }
}

// Zeroes a row's data padding; called by thread 0 of the row's last block.
__device__ __forceinline__ void zero_row_padding(uint8_t* data, int64_t length, int bits) {
  for (int64_t i = ceil_div(length * bits, 8); i < data_bytes(length, bits); ++i) data[i] = 0;
}

// Quantizes one block whose i-th value is value(i), for i < n: absmax reduce,
// scale, packed pairs, then thread 0 stores the scale (and the row's padding
// after its last block). Shared by the plain and the fused-reduce quantizers.
template <typename Value>
__device__ void quantize_block(Value value, int64_t n, int bits, bool stochastic, uint64_t seed, uint64_t index0,
                               uint8_t* row, int64_t k, int64_t nb, int64_t length, int64_t block) {
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = max(m, abs_bits(value(i)));
  m = block_max_u32(m);
  const int qmax = qmax_for_bits(bits);
  const float scale = scale_from_max_bits(m, qmax);
  const bool usable = scale_is_usable(scale);
  const float fq = static_cast<float>(qmax);
  uint8_t* data = row + 4 * nb + k * block * bits / 8;
  for (int64_t p = threadIdx.x; 2 * p < n; p += blockDim.x) {
    const int64_t e = 2 * p;
    const bool has_hi = e + 1 < n;
    int q0 = 0, q1 = 0;
    if (usable) {
      q0 = quantize_one(value(e), scale, fq, stochastic, seed, index0 + e);
      if (has_hi) q1 = quantize_one(value(e + 1), scale, fq, stochastic, seed, index0 + e + 1);
    }
    store_pair(data, e, bits, q0, q1, has_hi);
  }
  if (threadIdx.x == 0) {
    reinterpret_cast<float*>(row)[k] = scale;
    if (k == nb - 1) zero_row_padding(row + 4 * nb, length, bits);
  }
}

template <typename T>
__global__ void quantize_rows_kernel(const T* __restrict__ x, uint8_t* __restrict__ packed, int64_t length, int bits,
                                     int64_t block, bool stochastic, uint64_t seed, bool reorder, int64_t nodes,
                                     int64_t node_size, int64_t stages) {
  const int64_t nb = num_blocks(length, block);
  const int64_t r = blockIdx.x / nb, k = blockIdx.x % nb;
  const int64_t e0 = k * block;
  const int64_t n = min(block, length - e0);
  const T* xb = x + r * length + e0;
  const int64_t out_row = reorder ? reorder_slot_of_input_row(r, stages, node_size, nodes) : r;
  quantize_block([=](int64_t i) { return load_f32(xb, i); }, n, bits, stochastic, seed,
                 static_cast<uint64_t>(r * length + e0), packed + out_row * row_bytes(length, bits, block), k, nb,
                 length, block);
}

template <typename T>
__global__ void dequantize_rows_kernel(const uint8_t* __restrict__ packed, T* __restrict__ out, int64_t length,
                                       int bits, int64_t block) {
  const int64_t nb = num_blocks(length, block);
  const int64_t r = blockIdx.x / nb, k = blockIdx.x % nb;
  const int64_t e0 = k * block;
  const int64_t n = min(block, length - e0);
  const uint8_t* row = packed + r * row_bytes(length, bits, block);
  const float s = reinterpret_cast<const float*>(row)[k];
  const uint8_t* data = row + 4 * nb;
  T* y = out + r * length + e0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    store_f32(y, i, f32_mul(static_cast<float>(load_q(data, e0 + i, bits)), s));
}

// fp32 sum over chunks of element e of row k (chunk order fixed, mul then add).
__device__ __forceinline__ float reduce_element(const uint8_t* packed_in, int64_t chunks, int64_t rows, int64_t rb,
                                                int64_t nb_in, int64_t k, int64_t e, int bits, int64_t block) {
  float acc = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* row = packed_in + (c * rows + k) * rb;
    const float s = reinterpret_cast<const float*>(row)[e / block];
    acc = f32_add(acc, f32_mul(static_cast<float>(load_q(row + 4 * nb_in, e, bits)), s));
  }
  return acc;
}

__global__ void dequant_reduce_quantize_kernel(const uint8_t* __restrict__ packed_in, uint8_t* __restrict__ packed_out,
                                               int64_t chunks, int64_t rows, int64_t length, int bits_in,
                                               int64_t block_in, int bits_out, int64_t block_out, bool stochastic,
                                               uint64_t seed) {
  const int64_t nb_out = num_blocks(length, block_out);
  const int64_t k = blockIdx.x / nb_out, j = blockIdx.x % nb_out;
  const int64_t e0 = j * block_out;
  const int64_t n = min(block_out, length - e0);
  const int64_t rb_in = row_bytes(length, bits_in, block_in), nb_in = num_blocks(length, block_in);
  // The sum is recomputed for the quantize pass rather than staged (see the file comment).
  auto sum = [=](int64_t i) {
    return reduce_element(packed_in, chunks, rows, rb_in, nb_in, k, e0 + i, bits_in, block_in);
  };
  quantize_block(sum, n, bits_out, stochastic, seed, static_cast<uint64_t>(k * length + e0),
                 packed_out + k * row_bytes(length, bits_out, block_out), j, nb_out, length, block_out);
}

template <typename T>
__global__ void dequant_reduce_kernel(const uint8_t* __restrict__ packed_in, T* __restrict__ out, int64_t chunks,
                                      int64_t rows, int64_t length, int bits, int64_t block, float divisor) {
  const int64_t nb = num_blocks(length, block);
  const int64_t k = blockIdx.x / nb, j = blockIdx.x % nb;
  const int64_t e0 = j * block;
  const int64_t n = min(block, length - e0);
  const int64_t rb = row_bytes(length, bits, block);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    store_f32(out + k * length, e0 + i, f32_div(reduce_element(packed_in, chunks, rows, rb, nb, k, e0 + i, bits, block), divisor));
}

template <typename Launch>
void dispatch_type(FloatType type, Launch launch) {
  switch (type) {
    case FloatType::kFloat32: launch(static_cast<float*>(nullptr)); break;
    case FloatType::kBFloat16: launch(static_cast<__nv_bfloat16*>(nullptr)); break;
    case FloatType::kFloat16: launch(static_cast<__half*>(nullptr)); break;
  }
}

}  // namespace

void launch_quantize_rows(const void* x, FloatType type, uint8_t* packed, int64_t rows, int64_t length, int bits,
                          int64_t block, bool stochastic, uint64_t seed, bool reorder, int64_t nodes,
                          int64_t node_size, int64_t stages, cudaStream_t stream) {
  const int64_t grid = rows * num_blocks(length, block);
  if (grid == 0) return;
  dispatch_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    quantize_rows_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), packed, length, bits, block,
                                                           stochastic, seed, reorder, nodes, node_size, stages);
  });
}

void launch_dequantize_rows(const uint8_t* packed, void* out, FloatType type, int64_t rows, int64_t length, int bits,
                            int64_t block, cudaStream_t stream) {
  const int64_t grid = rows * num_blocks(length, block);
  if (grid == 0) return;
  dispatch_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dequantize_rows_kernel<T><<<grid, kThreads, 0, stream>>>(packed, static_cast<T*>(out), length, bits, block);
  });
}

void launch_dequant_reduce_quantize(const uint8_t* packed_in, uint8_t* packed_out, int64_t chunks, int64_t rows,
                                    int64_t length, int bits_in, int64_t block_in, int bits_out, int64_t block_out,
                                    bool stochastic, uint64_t seed, cudaStream_t stream) {
  const int64_t grid = rows * num_blocks(length, block_out);
  if (grid == 0) return;
  dequant_reduce_quantize_kernel<<<grid, kThreads, 0, stream>>>(packed_in, packed_out, chunks, rows, length, bits_in,
                                                                block_in, bits_out, block_out, stochastic, seed);
}

void launch_dequant_reduce(const uint8_t* packed_in, void* out, FloatType type, int64_t chunks, int64_t rows,
                           int64_t length, int bits, int64_t block, float divisor, cudaStream_t stream) {
  const int64_t grid = rows * num_blocks(length, block);
  if (grid == 0) return;
  dispatch_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dequant_reduce_kernel<T><<<grid, kThreads, 0, stream>>>(packed_in, static_cast<T*>(out), chunks, rows, length,
                                                            bits, block, divisor);
  });
}

}  // namespace cuda
}  // namespace zpp
