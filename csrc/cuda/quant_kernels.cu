// CUDA kernels of the blocked INT8/INT4 ops. Same contract and the same bits
// as the CPU kernels: every rounding, index and packing decision comes from
// zpp/quant_math.h, and the work decomposition (chunks of 8 elements, lanes of
// a group, whole-word packing) from zpp/quant_chunks.h, which the CPU build also
// runs (torch.ops.megatron_zpp._cuda_schedule_*, tests/test_kernels.py). Device
// float math uses the _rn helpers (no FMA; the build also passes --fmad=false).
//
// Mapping, all kernels 256-thread CTAs with grid-stride loops over 64-bit indices:
// - quantize (plain and qgZ-reordered) and the fused dequant+reduce+quantize:
//   a group of `lanes` threads per quantization block (quant_chunks.h
//   group_shape: block 128 -> 16 lanes, 16 blocks per CTA; 256 -> a warp; up to
//   2048 a warp, up to 16384 the CTA). Each lane stages its chunks' fp32 values
//   in registers, the group max-reduces |x| bit patterns (warp shuffles, plus
//   shared memory for a CTA group), then quantizes the staged values: inputs are
//   read once and the fused kernel sums over the input chunks once per element.
//   Blocks > 16384 elements stream: their second pass re-reads (re-sums).
// - dequantize and dequant+reduce (mean): elementwise, one thread per chunk.
// Float inputs and outputs move in 16-byte vectors where the chunk is full and
// aligned (fp32: two, bf16/fp16: one), packed data in 4-byte words.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "zpp/cuda_float_io.cuh"
#include "zpp/cuda_launchers.h"
#include "zpp/quant_chunks.h"
#include "zpp/quant_math.h"

namespace zpp {
namespace cuda {
namespace {

using chunks::kChunk;
using chunks::kCtaThreads;
using chunks::kWarp;

constexpr unsigned kFull = 0xffffffffu;
constexpr int64_t kMaxGrid = int64_t(1) << 20;  // grid-stride loops cover the rest

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The chunk at p (cnt valid values) as fp32.
__device__ __forceinline__ void load_chunk(const float* __restrict__ p, int cnt, float (&v)[kChunk]) {
  if (cnt == kChunk && aligned16(p)) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll  // constant trip count: v stays in registers (a cnt-bounded loop puts it on the stack)
    for (int i = 0; i < kChunk; ++i)
      if (i < cnt) v[i] = p[i];
  }
}

template <typename T16>  // __nv_bfloat16 or __half: 8 values are one 16-byte vector
__device__ __forceinline__ void load_chunk(const T16* __restrict__ p, int cnt, float (&v)[kChunk]) {
  if (cnt == kChunk && aligned16(p)) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    T16 h[kChunk];
    memcpy(h, &u, sizeof(u));
#pragma unroll
    for (int i = 0; i < kChunk; ++i) v[i] = load_f32(h, i);
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      if (i < cnt) v[i] = load_f32(p, i);
  }
}

// Stores the chunk's first cnt values, narrowed round-to-nearest-even.
__device__ __forceinline__ void store_chunk(float* __restrict__ p, int cnt, const float (&v)[kChunk]) {
  if (cnt == kChunk && aligned16(p)) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      if (i < cnt) p[i] = v[i];
  }
}

template <typename T16>
__device__ __forceinline__ void store_chunk(T16* __restrict__ p, int cnt, const float (&v)[kChunk]) {
  if (cnt == kChunk && aligned16(p)) {
    T16 h[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) store_f32(h, i, v[i]);
    uint4 u;
    memcpy(&u, h, sizeof(u));
    *reinterpret_cast<uint4*>(p) = u;
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      if (i < cnt) store_f32(p, i, v[i]);
  }
}

// Max over the group of `lanes` threads containing this one; every thread of the
// warp (CTA when lanes > 32) must call it, idle groups with 0. Max is
// order-independent, so this equals the CPU's sequential max.
__device__ __forceinline__ uint32_t group_max(uint32_t v, int lanes, uint32_t* warp_max) {
  const int width = lanes < kWarp ? lanes : kWarp;  // groups are aligned slices: xor stays inside
  for (int off = width / 2; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(kFull, v, off));
  if (lanes > kWarp) {  // the whole CTA (a CTA-uniform branch)
    if ((threadIdx.x & (kWarp - 1)) == 0) warp_max[threadIdx.x / kWarp] = v;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kCtaThreads / kWarp; ++i) v = max(v, warp_max[i]);
    __syncthreads();  // warp_max is reused by the next block
  }
  return v;
}

template <typename T>
struct InputSource {  // the block's values straight from x
  const T* xb;
  __device__ __forceinline__ void load(int64_t c, int cnt, float (&v)[kChunk]) const {
    load_chunk(xb + c * kChunk, cnt, v);
  }
};

// The Hadamard rotation of a block staged in a group's registers (quant_chunks.h, "Hadamard runs
// over threads"): groups of at most a warp, the host checks chunks::group_rotation_fused.
// log2h == 0: nothing. Every lane of the warp runs every stage (shuffles), idle groups included.
template <int V>
__device__ __forceinline__ void group_rotate(float (&v)[V][kChunk], int64_t n, int lane, int lanes, int log2h) {
  if (log2h == 0) return;  // uniform: a kernel argument
  const int stages = chunks::rotation_stages(log2h);
  for (int st = 0; st < stages; ++st)
    chunks::lane_rotation_stage<V>(v, n, lane, lanes, log2h, st, [&](int s, int i, int64_t dc) {
      return __shfl_xor_sync(kFull, v[s][i], static_cast<int>(dc));
    });
  chunks::lane_rotation_scale<V>(v, n, lane, lanes, log2h);
}

// Quantizes one block of n values into a packed row (scale k, data from element e0) with this
// thread's group. n == 0: the group is idle this round and only joins the max.
// V: chunks per lane staged in registers, 0 = streamed (see quant_chunks.h). log2h_a, log2h_b: the
// rotations applied to the staged values before the absmax, in that order (0: none; staged groups
// of <= 32 lanes only).
template <int V, typename Source>
__device__ __forceinline__ void quantize_group(Source& src, int64_t n, int lanes, int bits, bool stochastic,
                                               uint64_t seed, uint64_t index0, uint8_t* row, int64_t nb, int64_t k,
                                               int64_t e0, uint32_t* warp_max, int log2h_a, int log2h_b) {
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  chunks::RowSink sink{row + 4 * nb, e0, bits};
  chunks::BlockQuant q;
  if constexpr (V > 0) {
    float v[V][kChunk];
    uint32_t m = chunks::lane_stage<V>(src, n, lane, lanes, v);
    if (log2h_a | log2h_b) {
      group_rotate<V>(v, n, lane, lanes, log2h_a);
      group_rotate<V>(v, n, lane, lanes, log2h_b);
      m = chunks::lane_staged_absmax<V>(v, n, lane, lanes);
    }
    m = group_max(m, lanes, warp_max);
    if (n == 0) return;
    q = chunks::block_quant(m, bits, stochastic, seed);
    chunks::lane_quantize<V>(sink, v, n, lane, lanes, bits, q, index0);
  } else {
    const uint32_t m = group_max(chunks::lane_absmax_streamed(src, n, lane, lanes), lanes, warp_max);
    if (n == 0) return;
    q = chunks::block_quant(m, bits, stochastic, seed);
    chunks::lane_quantize_streamed(src, sink, n, lane, lanes, bits, q, index0);
  }
  if (lane == 0) reinterpret_cast<float*>(row)[k] = q.scale;
}

// Row r of x (rows x length) -> packed row r, or reorder_slot_of_input_row(r) when reorder.
template <int V, typename T>
__global__ void __launch_bounds__(kCtaThreads)
    quantize_rows_kernel(const T* __restrict__ x, uint8_t* __restrict__ packed, int64_t rows, int64_t length,
                         int bits, int64_t block, int lanes, bool stochastic, uint64_t seed, bool reorder,
                         int64_t nodes, int64_t node_size, int64_t stages, int log2h) {
  __shared__ uint32_t warp_max[kCtaThreads / kWarp];
  const int64_t nb = num_blocks(length, block), total = rows * nb, rb = row_bytes(length, bits, block);
  const int per_cta = kCtaThreads / lanes;
  const int group = static_cast<int>(threadIdx.x) / lanes;
  // The loop bound depends only on the CTA's base: every thread runs every round (shuffles, syncs).
  for (int64_t base = int64_t(blockIdx.x) * per_cta; base < total; base += int64_t(gridDim.x) * per_cta) {
    const int64_t b = base + group;
    int64_t r = 0, k = 0, n = 0;
    if (b < total) {
      r = b / nb;
      k = b - r * nb;
      n = min(block, length - k * block);
    }
    const int64_t e0 = k * block;
    const int64_t out_row = reorder ? reorder_slot_of_input_row(r, stages, node_size, nodes) : r;
    InputSource<T> src{x + r * length + e0};
    quantize_group<V>(src, n, lanes, bits, stochastic, seed, static_cast<uint64_t>(r * length + e0),
                      packed + out_row * rb, nb, k, e0, warp_max, log2h, 0);
  }
}

// packed_in [chunks][rows][rb_in] -> packed_out [rows][rb_out]: block j of row k is the fp32 sum
// over the chunks (in chunk order), requantized.
template <int V>
__global__ void __launch_bounds__(kCtaThreads)
    dequant_reduce_quantize_kernel(const uint8_t* __restrict__ packed_in, uint8_t* __restrict__ packed_out,
                                   int64_t chunks, int64_t rows, int64_t length, int bits_in, int64_t block_in,
                                   int bits_out, int64_t block_out, int lanes, bool stochastic, uint64_t seed,
                                   int log2h_in, int log2h_out) {
  __shared__ uint32_t warp_max[kCtaThreads / kWarp];
  const int64_t nb_out = num_blocks(length, block_out), total = rows * nb_out;
  const int64_t rb_in = row_bytes(length, bits_in, block_in), nb_in = num_blocks(length, block_in);
  const int64_t rb_out = row_bytes(length, bits_out, block_out);
  const int per_cta = kCtaThreads / lanes;
  const int group = static_cast<int>(threadIdx.x) / lanes;
  for (int64_t base = int64_t(blockIdx.x) * per_cta; base < total; base += int64_t(gridDim.x) * per_cta) {
    const int64_t b = base + group;
    int64_t k = 0, j = 0, n = 0;
    if (b < total) {
      k = b / nb_out;
      j = b - k * nb_out;
      n = min(block_out, length - j * block_out);
    }
    const int64_t e0 = j * block_out;
    chunks::ReduceSource src{packed_in, chunks, rows, rb_in, nb_in, k, e0, bits_in, block_in};
    quantize_group<V>(src, n, lanes, bits_out, stochastic, seed, static_cast<uint64_t>(k * length + e0),
                      packed_out + k * rb_out, nb_out, j, e0, warp_max, log2h_in, log2h_out);
  }
}

// The chunk at element e of a packed row (nb scales first), decoded to fp32.
__device__ __forceinline__ void decode_chunk(const uint8_t* row, int64_t nb, int64_t e, int cnt, int bits,
                                             int64_t block, float (&v)[kChunk]) {
  uint32_t w[2];
  chunks::load_chunk_words(row + 4 * nb, e, cnt, bits, w);
  chunks::dequantize_chunk(w, bits, chunks::load_f32_scale(row, e / block), v);
}

// Stores a decoded chunk; kAccumulate: out = cast(decoded + fp32(out)), one rounding (qWD's decode-and-add).
template <bool kAccumulate, typename T>
__device__ __forceinline__ void store_decoded(T* out, int cnt, float (&v)[kChunk]) {
  if constexpr (kAccumulate) {
    float base[kChunk];
    load_chunk(out, cnt, base);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) v[i] = f32_add(v[i], base[i]);
  }
  store_chunk(out, cnt, v);
}

template <typename T, bool kAccumulate>
__global__ void __launch_bounds__(kCtaThreads)
    dequantize_rows_kernel(const uint8_t* __restrict__ packed, T* __restrict__ out, int64_t rows, int64_t length,
                           int bits, int64_t block) {
  const int64_t per_row = ceil_div(length, kChunk), total = rows * per_row;
  const int64_t nb = num_blocks(length, block), rb = row_bytes(length, bits, block);
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = t / per_row, e = (t - r * per_row) * kChunk;
    const int cnt = chunks::chunk_count(length - e, 0);
    float v[kChunk];
    decode_chunk(packed + r * rb, nb, e, cnt, bits, block, v);
    store_decoded<kAccumulate>(out + r * length + e, cnt, v);
  }
}

template <typename T>
__global__ void __launch_bounds__(kCtaThreads)
    dequant_reduce_kernel(const uint8_t* __restrict__ packed_in, T* __restrict__ out, int64_t chunks, int64_t rows,
                          int64_t length, int bits, int64_t block, float divisor) {
  const int64_t per_row = ceil_div(length, kChunk), total = rows * per_row;
  const int64_t nb = num_blocks(length, block), rb = row_bytes(length, bits, block);
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = t / per_row, e = (t - k * per_row) * kChunk;
    const int cnt = chunks::chunk_count(length - e, 0);
    float acc[kChunk];
    chunks::reduce_chunk(packed_in, chunks, rows, rb, nb, k, e, cnt, bits, block, acc);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) acc[i] = f32_div(acc[i], divisor);
    store_chunk(out + k * length + e, cnt, acc);
  }
}

// The rotated elementwise kernels: one thread per chunk, each row's chunks padded to whole runs of
// rc = h / 8 <= 32 chunks (chunks::padded_row_chunks), so the chunks of a run are adjacent lanes of one
// warp and a cross-chunk stage is a shuffle. Threads are taken a warp at a time (the loop bound is
// the warp's first thread), so every lane reaches every shuffle; padding and tail lanes hold no data.
__device__ __forceinline__ void chunk_rotate(float (&v)[kChunk], int64_t c, int64_t n, int log2h) {
  chunks::chunk_stages(v, c * kChunk, n, log2h);
  for (int64_t dc = 1; dc < chunks::run_chunks(log2h); dc <<= 1) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float p = __shfl_xor_sync(kFull, v[i], static_cast<int>(dc));
      v[i] = chunks::cross_chunk_value(v[i], p, c, n, dc, log2h);
    }
  }
  chunks::chunk_run_scale(v, c * kChunk, n, log2h);
}

// Calls fn(row, chunk, its first element, valid count) for every thread of the padded map, a warp at
// a time (tail and padding threads get a count of 0 and must still reach the shuffles).
template <typename Fn>
__device__ __forceinline__ void for_each_padded_chunk(int64_t rows, int64_t length, int log2h, Fn fn) {
  const int64_t per_row = chunks::padded_row_chunks(length, log2h), total = rows * per_row;
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  for (int64_t t0 = int64_t(blockIdx.x) * blockDim.x + (threadIdx.x - lane); t0 < total;
       t0 += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = t0 + lane;
    const int64_t r = t / per_row, c = t - r * per_row, e = c * kChunk;
    fn(r, c, e, t < total ? chunks::chunk_count(length - e, 0) : 0);
  }
}

template <typename T, bool kAccumulate>
__global__ void __launch_bounds__(kCtaThreads)
    dequantize_rows_rotated_kernel(const uint8_t* __restrict__ packed, T* __restrict__ out, int64_t rows,
                                   int64_t length, int bits, int64_t block, int log2h) {
  const int64_t nb = num_blocks(length, block), rb = row_bytes(length, bits, block);
  for_each_padded_chunk(rows, length, log2h, [&](int64_t r, int64_t c, int64_t e, int cnt) {
    float v[kChunk] = {};
    if (cnt > 0) decode_chunk(packed + r * rb, nb, e, cnt, bits, block, v);
    chunk_rotate(v, c, length, log2h);
    if (cnt > 0) store_decoded<kAccumulate>(out + r * length + e, cnt, v);
  });
}

template <typename T>
__global__ void __launch_bounds__(kCtaThreads)
    dequant_reduce_rotated_kernel(const uint8_t* __restrict__ packed_in, T* __restrict__ out, int64_t chunks,
                                  int64_t rows, int64_t length, int bits, int64_t block, float divisor, int log2h) {
  const int64_t nb = num_blocks(length, block), rb = row_bytes(length, bits, block);
  for_each_padded_chunk(rows, length, log2h, [&](int64_t k, int64_t c, int64_t e, int cnt) {
    float acc[kChunk] = {};
    if (cnt > 0) chunks::reduce_chunk(packed_in, chunks, rows, rb, nb, k, e, cnt, bits, block, acc);
    chunk_rotate(acc, c, length, log2h);
    if (cnt > 0) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) acc[i] = f32_div(acc[i], divisor);
      store_chunk(out + k * length + e, cnt, acc);
    }
  });
}

// The binding composes the shapes the kernels do not rotate in registers; a launcher asked for one
// anyway would shuffle across group or warp bounds (wrong bytes, silently): refuse.
void check_fused(bool fused, const char* launcher) {
  if (!fused)
    throw std::invalid_argument(std::string("megatron_zpp: ") + launcher +
                                ": this shape's Hadamard rotation is not fused (quant_chunks.h *_rotation_fused)");
}

unsigned grid_for(int64_t items, int64_t per_cta) {
  const int64_t g = ceil_div(items, per_cta);
  return static_cast<unsigned>(g < kMaxGrid ? g : kMaxGrid);
}

template <typename Launch>
void dispatch_type(FloatType type, Launch launch) {
  switch (type) {
    case FloatType::kFloat32: launch(static_cast<float*>(nullptr)); break;
    case FloatType::kBFloat16: launch(static_cast<__nv_bfloat16*>(nullptr)); break;
    case FloatType::kFloat16: launch(static_cast<__half*>(nullptr)); break;
  }
}

template <typename Launch>
void dispatch_chunks_per_lane(int v, Launch launch) {
  switch (v) {
    case 1: launch(std::integral_constant<int, 1>{}); break;
    case 2: launch(std::integral_constant<int, 2>{}); break;
    case 4: launch(std::integral_constant<int, 4>{}); break;
    case 8: launch(std::integral_constant<int, 8>{}); break;
    default: launch(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace

void launch_quantize_rows(const void* x, FloatType type, uint8_t* packed, int64_t rows, int64_t length, int bits,
                          int64_t block, bool stochastic, uint64_t seed, bool reorder, int64_t nodes,
                          int64_t node_size, int64_t stages, cudaStream_t stream, int log2h) {
  check_fused(log2h == 0 || chunks::group_rotation_fused(block), "launch_quantize_rows");
  const int64_t blocks = rows * num_blocks(length, block);
  if (blocks == 0) return;
  const chunks::GroupShape shape = chunks::group_shape(block);
  const unsigned grid = grid_for(blocks, kCtaThreads / shape.lanes);
  dispatch_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dispatch_chunks_per_lane(shape.chunks_per_lane, [&](auto v) {
      quantize_rows_kernel<decltype(v)::value, T><<<grid, kCtaThreads, 0, stream>>>(
          static_cast<const T*>(x), packed, rows, length, bits, block, shape.lanes, stochastic, seed, reorder, nodes,
          node_size, stages, log2h);
    });
  });
}

void launch_dequantize_rows(const uint8_t* packed, void* out, FloatType type, int64_t rows, int64_t length, int bits,
                            int64_t block, cudaStream_t stream, bool accumulate, int log2h) {
  check_fused(chunks::chunk_rotation_fused(log2h), "launch_dequantize_rows");
  const int64_t items = rows * ceil_div(length, kChunk);
  if (items == 0) return;
  dispatch_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (log2h) {
      const int64_t threads = rows * chunks::padded_row_chunks(length, log2h);
      if (accumulate)
        dequantize_rows_rotated_kernel<T, true><<<grid_for(threads, kCtaThreads), kCtaThreads, 0, stream>>>(
            packed, static_cast<T*>(out), rows, length, bits, block, log2h);
      else
        dequantize_rows_rotated_kernel<T, false><<<grid_for(threads, kCtaThreads), kCtaThreads, 0, stream>>>(
            packed, static_cast<T*>(out), rows, length, bits, block, log2h);
    } else if (accumulate) {
      dequantize_rows_kernel<T, true><<<grid_for(items, kCtaThreads), kCtaThreads, 0, stream>>>(
          packed, static_cast<T*>(out), rows, length, bits, block);
    } else {
      dequantize_rows_kernel<T, false><<<grid_for(items, kCtaThreads), kCtaThreads, 0, stream>>>(
          packed, static_cast<T*>(out), rows, length, bits, block);
    }
  });
}

void launch_dequant_reduce_quantize(const uint8_t* packed_in, uint8_t* packed_out, int64_t chunks, int64_t rows,
                                    int64_t length, int bits_in, int64_t block_in, int bits_out, int64_t block_out,
                                    bool stochastic, uint64_t seed, cudaStream_t stream, int log2h_in,
                                    int log2h_out) {
  check_fused((log2h_in == 0 && log2h_out == 0) || chunks::group_rotation_fused(block_out),
              "launch_dequant_reduce_quantize");
  const int64_t blocks = rows * num_blocks(length, block_out);
  if (blocks == 0) return;
  const chunks::GroupShape shape = chunks::group_shape(block_out);
  const unsigned grid = grid_for(blocks, kCtaThreads / shape.lanes);
  dispatch_chunks_per_lane(shape.chunks_per_lane, [&](auto v) {
    dequant_reduce_quantize_kernel<decltype(v)::value><<<grid, kCtaThreads, 0, stream>>>(
        packed_in, packed_out, chunks, rows, length, bits_in, block_in, bits_out, block_out, shape.lanes, stochastic,
        seed, log2h_in, log2h_out);
  });
}

void launch_dequant_reduce(const uint8_t* packed_in, void* out, FloatType type, int64_t chunks, int64_t rows,
                           int64_t length, int bits, int64_t block, float divisor, cudaStream_t stream, int log2h) {
  check_fused(chunks::chunk_rotation_fused(log2h), "launch_dequant_reduce");
  const int64_t items = rows * ceil_div(length, kChunk);
  if (items == 0) return;
  dispatch_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (log2h) {
      dequant_reduce_rotated_kernel<T><<<grid_for(rows * chunks::padded_row_chunks(length, log2h), kCtaThreads),
                                         kCtaThreads, 0, stream>>>(packed_in, static_cast<T*>(out), chunks, rows,
                                                                   length, bits, block, divisor, log2h);
      return;
    }
    dequant_reduce_kernel<T><<<grid_for(items, kCtaThreads), kCtaThreads, 0, stream>>>(
        packed_in, static_cast<T*>(out), chunks, rows, length, bits, block, divisor);
  });
}

// Hadamard smoothing, one thread per run of 2^log2h values (quant_math.h hadamard_run, in place in
// global memory). Not fused into the quantize kernels yet: the binding composes it with them
// (quant_cuda_binding.cpp), which costs one extra fp32 pass over the data.
__global__ void hadamard_runs_kernel(float* __restrict__ v, int64_t rows, int64_t length, int log2h) {
  const int64_t runs_per_row = length >> log2h;
  const int64_t runs = rows * runs_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < runs; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / runs_per_row, j = i % runs_per_row;
    hadamard_run(v + r * length + (j << log2h), log2h);
  }
}

void launch_hadamard_runs(float* v, int64_t rows, int64_t length, int log2h, cudaStream_t stream) {
  const int64_t runs = rows * (length >> log2h);
  if (runs == 0) return;
  hadamard_runs_kernel<<<grid_for(runs, kCtaThreads), kCtaThreads, 0, stream>>>(v, rows, length, log2h);
}

}  // namespace cuda
}  // namespace zpp
