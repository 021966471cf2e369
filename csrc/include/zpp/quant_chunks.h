// Work decomposition of the CUDA blocked INT8/INT4 kernels (csrc/cuda/quant_kernels.cu), written
// once for host and device so the CPU build can run the same schedule (the test-only op
// megatron_zpp::_cuda_schedule_* in csrc/cpu/quant_cpu.cpp) and tests/test_kernels.py can check it
// against the CPU kernels bit for bit without a GPU.
//
// A *chunk* is 8 consecutive elements of a row. Blocks are multiples of 8 elements, so a chunk
// never straddles two quantization blocks, and its packed bytes are whole 32-bit words at a
// 4-byte aligned offset (INT8: 2 words, INT4: 1 word). A thread owns whole chunks: it reads its
// inputs with 16-byte vector loads where aligned and writes whole words, so no two threads ever
// share a byte. A row's last chunk may hold fewer than 8 elements; the words covering it end
// exactly at the row's 4-byte-aligned data end, so writing them with zeros past the last element
// is the row padding (no separate padding pass).
//
// Quantizing: a *group* of `lanes` threads owns one quantization block. lane l takes chunks
// l, l + lanes, l + 2*lanes, ... (adjacent lanes, adjacent chunks: coalesced). With
// chunks_per_lane > 0 a lane keeps its chunks' fp32 values in registers between the absmax and
// the quantize pass, so each value is loaded (or, in the fused kernel, reduced over the chunks)
// once; chunks_per_lane == 0 (blocks > 16384 elements) re-reads (re-reduces) in the second pass.
// absmax is a max of bit patterns: order-independent, so the group's max equals the CPU's.
#pragma once

#include <stdint.h>
#include <string.h>

#include "zpp/quant_math.h"

#if defined(__CUDACC__)
#define ZPP_UNROLL _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__clang__)
#define ZPP_UNROLL _Pragma("GCC unroll 8")
#else
#define ZPP_UNROLL
#endif

namespace zpp {
namespace chunks {

constexpr int kChunk = 8;          // elements per chunk
constexpr int kWarp = 32;
constexpr int kCtaThreads = 256;   // threads per CTA of every blocked-quant kernel
constexpr int kMaxChunksPerLane = 8;

struct GroupShape {
  int lanes;            // threads per quantization block: a power of two <= 32 (a warp slice), or kCtaThreads
  int chunks_per_lane;  // register-staged chunks per thread (1, 2, 4, 8), or 0: streamed
};

ZPP_HD int pow2_at_least(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Smallest group that stages a whole block in registers: a warp slice for blocks <= 2048
// elements (block 128: 16 lanes, two blocks per warp, 16 blocks per 256-thread CTA), a whole
// CTA up to 16384, then a streamed CTA.
ZPP_HD GroupShape group_shape(int64_t block) {
  const int64_t c = ceil_div(block, kChunk);
  if (c <= kWarp) return {pow2_at_least(c), 1};
  if (c <= int64_t(kWarp) * kMaxChunksPerLane) return {kWarp, pow2_at_least(ceil_div(c, kWarp))};
  if (c <= int64_t(kCtaThreads) * kMaxChunksPerLane) return {kCtaThreads, pow2_at_least(ceil_div(c, kCtaThreads))};
  return {kCtaThreads, 0};
}

// Valid elements of chunk c of a block of n elements (0 past the end).
ZPP_HD int chunk_count(int64_t n, int64_t c) {
  const int64_t left = n - c * kChunk;
  return left <= 0 ? 0 : (left < kChunk ? static_cast<int>(left) : kChunk);
}

// Words holding a chunk of cnt >= 1 elements (INT8 4 values a word, INT4 8).
ZPP_HD int chunk_words(int cnt, int bits) { return bits == 8 ? (cnt > 4 ? 2 : 1) : 1; }

// Byte offset, in a row's data, of the chunk starting at element e (e a multiple of 8).
ZPP_HD int64_t chunk_byte(int64_t e, int bits) { return e * bits / 8; }

ZPP_HD uint32_t load_u32(const uint8_t* p) {  // p is 4-byte aligned on device
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t w;
  memcpy(&w, p, 4);
  return w;
#endif
}

ZPP_HD void store_u32(uint8_t* p, uint32_t w) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(p) = w;
#else
  memcpy(p, &w, 4);
#endif
}

ZPP_HD float load_f32_scale(const uint8_t* row, int64_t k) {
  const uint32_t b = load_u32(row + 4 * k);
  float s;
#if defined(__CUDA_ARCH__)
  s = __uint_as_float(b);
#else
  memcpy(&s, &b, 4);
#endif
  return s;
}

ZPP_HD uint32_t abs_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v) & 0x7fffffffu;
#else
  uint32_t b;
  memcpy(&b, &v, 4);
  return b & 0x7fffffffu;
#endif
}

// Max of |v| bit patterns over the chunk's cnt valid values (NaN/Inf: >= 0x7f800000).
ZPP_HD uint32_t chunk_absmax_bits(const float (&v)[kChunk], int cnt) {
  uint32_t m = 0;
ZPP_UNROLL
  for (int i = 0; i < kChunk; ++i) {
    const uint32_t b = i < cnt ? abs_bits(v[i]) : 0u;
    m = m > b ? m : b;
  }
  return m;
}

// Everything the quantize pass needs once the group's absmax is known.
struct BlockQuant {
  float scale, fq;
  bool usable, stochastic;
  uint64_t seed;
};

ZPP_HD BlockQuant block_quant(uint32_t max_bits, int bits, bool stochastic, uint64_t seed) {
  const int qmax = qmax_for_bits(bits);
  float absmax;
#if defined(__CUDA_ARCH__)
  absmax = __uint_as_float(max_bits);
#else
  memcpy(&absmax, &max_bits, 4);
#endif
  const float scale = block_scale(absmax, max_bits >= 0x7f800000u, qmax);
  return {scale, static_cast<float>(qmax), scale_is_usable(scale), stochastic, seed};
}

// Quantizes and packs a chunk; elements past cnt (and every element of an unusable block) are 0.
// index = the stochastic-rounding counter of the chunk's first element.
ZPP_HD void quantize_chunk(const float (&v)[kChunk], int cnt, int bits, const BlockQuant& q, uint64_t index,
                           uint32_t (&w)[2]) {
  int qs[kChunk];
ZPP_UNROLL
  for (int i = 0; i < kChunk; ++i) {
    int r = 0;
    if (q.usable && i < cnt)
      r = q.stochastic ? quantize_stochastic_unchecked(v[i], q.scale, q.fq, stochastic_uniform(q.seed, index + i))
                       : quantize_nearest_unchecked(v[i], q.scale, q.fq);
    qs[i] = r;
  }
  if (bits == 8) {
ZPP_UNROLL
    for (int h = 0; h < 2; ++h)
      w[h] = (uint32_t(uint8_t(qs[4 * h])) | (uint32_t(uint8_t(qs[4 * h + 1])) << 8) |
              (uint32_t(uint8_t(qs[4 * h + 2])) << 16) | (uint32_t(uint8_t(qs[4 * h + 3])) << 24));
  } else {
    w[0] = uint32_t(pack_int4(qs[0], qs[1])) | (uint32_t(pack_int4(qs[2], qs[3])) << 8) |
           (uint32_t(pack_int4(qs[4], qs[5])) << 16) | (uint32_t(pack_int4(qs[6], qs[7])) << 24);
    w[1] = 0;
  }
}

// The i-th packed value of a chunk's words (little-endian bytes; INT4 low nibble first).
ZPP_HD int chunk_q(const uint32_t (&w)[2], int bits, int i) {
  if (bits == 8) return static_cast<int8_t>(static_cast<uint8_t>(w[i >> 2] >> (8 * (i & 3))));
  const uint8_t b = static_cast<uint8_t>(w[0] >> (8 * (i >> 1)));
  return (i & 1) ? unpack_int4_hi(b) : unpack_int4_lo(b);
}

// Loads the words of the chunk starting at element e of a row's data; only words that hold one of
// its cnt elements are read (they lie within the row's 4-byte-aligned data).
ZPP_HD void load_chunk_words(const uint8_t* data, int64_t e, int cnt, int bits, uint32_t (&w)[2]) {
  const uint8_t* p = data + chunk_byte(e, bits);
  w[0] = load_u32(p);
  w[1] = chunk_words(cnt, bits) > 1 ? load_u32(p + 4) : 0u;
}

ZPP_HD void store_chunk_words(uint8_t* data, int64_t e, int cnt, int bits, const uint32_t (&w)[2]) {
  uint8_t* p = data + chunk_byte(e, bits);
  store_u32(p, w[0]);
  if (chunk_words(cnt, bits) > 1) store_u32(p + 4, w[1]);
}

// out[i] = q_i * s (fp32, one rounding), for the chunk's values.
ZPP_HD void dequantize_chunk(const uint32_t (&w)[2], int bits, float s, float (&out)[kChunk]) {
ZPP_UNROLL
  for (int i = 0; i < kChunk; ++i) out[i] = f32_mul(static_cast<float>(chunk_q(w, bits, i)), s);
}

// acc = sum over c in [0, chunks) of q_c * scale_c, in chunk order, starting from 0: element for
// element the CPU kernels' and the reference's sum. Row k of chunk c is at
// packed_in + (c * rows + k) * rb; e is the chunk's first element (a multiple of 8, so its 8
// elements share one input block and one scale).
ZPP_HD void reduce_chunk(const uint8_t* packed_in, int64_t chunks, int64_t rows, int64_t rb, int64_t nb_in,
                         int64_t k, int64_t e, int cnt, int bits, int64_t block, float (&acc)[kChunk]) {
ZPP_UNROLL
  for (int i = 0; i < kChunk; ++i) acc[i] = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* row = packed_in + (c * rows + k) * rb;
    const float s = load_f32_scale(row, e / block);
    uint32_t w[2];
    load_chunk_words(row + 4 * nb_in, e, cnt, bits, w);
ZPP_UNROLL
    for (int i = 0; i < kChunk; ++i) acc[i] = f32_add(acc[i], f32_mul(static_cast<float>(chunk_q(w, bits, i)), s));
  }
}

// ------------------------------------------------------- one lane's part ----
// Source: load(c, cnt, float (&v)[8]) fills the block's chunk c (cnt valid values; the rest is
// ignored). Sink: store(c, cnt, const uint32_t (&w)[2]).

// Pass 1 (staged): loads the lane's chunks into v and returns their absmax bits.
template <int V, typename Source>
ZPP_HD uint32_t lane_stage(Source& src, int64_t n, int lane, int lanes, float (&v)[V][kChunk]) {
  uint32_t m = 0;
ZPP_UNROLL
  for (int j = 0; j < V; ++j) {
    const int64_t c = lane + int64_t(j) * lanes;
    const int cnt = chunk_count(n, c);
    if (cnt > 0) {
      src.load(c, cnt, v[j]);
      const uint32_t b = chunk_absmax_bits(v[j], cnt);
      m = m > b ? m : b;
    }
  }
  return m;
}

// The absmax bits of the lane's staged chunks (after an in-register rotation).
template <int V>
ZPP_HD uint32_t lane_staged_absmax(const float (&v)[V][kChunk], int64_t n, int lane, int lanes) {
  uint32_t m = 0;
ZPP_UNROLL
  for (int j = 0; j < V; ++j) {
    const int cnt = chunk_count(n, lane + int64_t(j) * lanes);
    if (cnt > 0) {
      const uint32_t b = chunk_absmax_bits(v[j], cnt);
      m = m > b ? m : b;
    }
  }
  return m;
}

// Pass 2 (staged): quantizes and stores the lane's staged chunks.
template <int V, typename Sink>
ZPP_HD void lane_quantize(Sink& sink, const float (&v)[V][kChunk], int64_t n, int lane, int lanes, int bits,
                          const BlockQuant& q, uint64_t index0) {
ZPP_UNROLL
  for (int j = 0; j < V; ++j) {
    const int64_t c = lane + int64_t(j) * lanes;
    const int cnt = chunk_count(n, c);
    if (cnt > 0) {
      uint32_t w[2];
      quantize_chunk(v[j], cnt, bits, q, index0 + uint64_t(c) * kChunk, w);
      sink.store(c, cnt, w);
    }
  }
}

// The streamed variants (chunks_per_lane == 0): pass 2 loads each chunk again.
template <typename Source>
ZPP_HD uint32_t lane_absmax_streamed(Source& src, int64_t n, int lane, int lanes) {
  uint32_t m = 0;
  for (int64_t c = lane; chunk_count(n, c) > 0; c += lanes) {
    float v[kChunk];
    const int cnt = chunk_count(n, c);
    src.load(c, cnt, v);
    const uint32_t b = chunk_absmax_bits(v, cnt);
    m = m > b ? m : b;
  }
  return m;
}

template <typename Source, typename Sink>
ZPP_HD void lane_quantize_streamed(Source& src, Sink& sink, int64_t n, int lane, int lanes, int bits,
                                   const BlockQuant& q, uint64_t index0) {
  for (int64_t c = lane; chunk_count(n, c) > 0; c += lanes) {
    float v[kChunk];
    const int cnt = chunk_count(n, c);
    src.load(c, cnt, v);
    uint32_t w[2];
    quantize_chunk(v, cnt, bits, q, index0 + uint64_t(c) * kChunk, w);
    sink.store(c, cnt, w);
  }
}

// ------------------------------------------ Hadamard runs over threads ----
// The fused rotated kernels apply quant_math.h hadamard_range to values spread over threads, chunk
// by chunk: stages of stride d < 8 pair elements inside a chunk, stages of stride d >= 8 pair chunk
// c with chunk c ^ (d / 8) (same element). Each element goes through the same fp32 operations as in
// hadamard_run, stage after stage in the same order, so the bits are the same; a run shorter than h
// at the end of a row (partial) is left as it is. Element indices e are relative to a row or to a
// block start (blocks start at multiples of h); n is the number of valid elements from there.
// In a quantizing group, lane l slot s holds chunk c = s * lanes + l: a chunk stride dc < lanes is
// the lane l ^ dc (a warp shuffle; groups of <= 32 lanes only), dc >= lanes the slot s ^ (dc / lanes).
// In the elementwise kernels a thread holds one chunk and a row's chunks are padded to whole runs, so
// the chunks of a run sit in adjacent lanes of one warp (runs of <= 32 chunks: h <= 256).

constexpr int kMaxFusedRunChunks = kWarp;  // h <= 256 in the elementwise kernels

// Whether the CUDA kernels rotate in registers (else the binding composes fp32 passes): quantizing
// groups of at most a warp (blocks <= 2048 elements), elementwise kernels with runs of <= 256.
ZPP_HD bool group_rotation_fused(int64_t block) { return group_shape(block).lanes <= kWarp; }
ZPP_HD bool chunk_rotation_fused(int log2h) { return log2h <= 8; }

// Whether the run holding element e (of n valid ones) is whole, so transformed.
ZPP_HD bool run_is_full(int64_t e, int64_t n, int log2h) {
  const int64_t h = int64_t(1) << log2h;
  return (e & ~(h - 1)) + h <= n;
}

// The butterfly of the element at the lower (sum) or upper (difference) index of a pair:
// hadamard_run's v[j] = a + b, v[j + d] = a - b with a the lower value, b the upper.
ZPP_HD float butterfly(float own, float partner, bool lower) {
  return lower ? f32_add(own, partner) : f32_add(partner, -own);
}

// The in-chunk stages (strides 1, 2, 4 below h) of the runs of the chunk starting at element e.
// Strides and indices are compile-time after unrolling (a run-time index into v would put the
// staged values in local memory on a GPU).
ZPP_HD void chunk_stages(float (&v)[kChunk], int64_t e, int64_t n, int log2h) {
  const int h = 1 << log2h;
ZPP_UNROLL
  for (int d = 1; d < kChunk; d <<= 1) {
    if (d >= h) continue;
ZPP_UNROLL
    for (int i = 0; i < kChunk; ++i) {
      if ((i & d) || !run_is_full(e + i, n, log2h)) continue;
      const float a = v[i], b = v[i + d];
      v[i] = f32_add(a, b);
      v[i + d] = f32_add(a, -b);
    }
  }
}

// One value of a cross-chunk stage (chunk stride dc): own and its partner's value before the stage.
ZPP_HD float cross_chunk_value(float own, float partner, int64_t c, int64_t n, int64_t dc, int log2h) {
  return run_is_full(c * kChunk, n, log2h) ? butterfly(own, partner, (c & dc) == 0) : own;
}

// The last step of the runs of a chunk: the multiply by hadamard_scale.
ZPP_HD void chunk_run_scale(float (&v)[kChunk], int64_t e, int64_t n, int log2h) {
  const float s = hadamard_scale(log2h);
ZPP_UNROLL
  for (int i = 0; i < kChunk; ++i)
    if (run_is_full(e + i, n, log2h)) v[i] = f32_mul(v[i], s);
}

// A cross-chunk stage whose partner chunks are in this lane's own slots (dc >= lanes): slot s pairs
// with slot s ^ sx, sx = dc / lanes. The slot stride is matched against compile-time candidates so
// that every index into v is a constant after unrolling (registers, not local memory).
template <int V>
ZPP_HD void lane_slot_stage(float (&v)[V][kChunk], int64_t n, int lane, int lanes, int64_t dc, int log2h) {
  if constexpr (V > 1) {
ZPP_UNROLL
    for (int sx = 1; sx < V; sx <<= 1) {
      if (int64_t(sx) * lanes != dc) continue;
ZPP_UNROLL
      for (int s = 0; s < V; ++s) {
        if (s & sx) continue;
        const int64_t c = lane + int64_t(s) * lanes;
        if (!run_is_full(c * kChunk, n, log2h)) continue;  // the partner chunk is in the same run
ZPP_UNROLL
        for (int i = 0; i < kChunk; ++i) {
          const float a = v[s][i], b = v[s + sx][i];
          v[s][i] = f32_add(a, b);
          v[s + sx][i] = f32_add(a, -b);
        }
      }
    }
  }
}

// Stage st of the rotation of a lane's staged chunks, every lane of the group in step: st 0 is the
// in-chunk stages, st >= 1 the cross-chunk stage of chunk stride 2^(st - 1). partner(s, i, dc)
// returns element i of slot s of lane ^ dc as it was before this stage; on a GPU it is a shuffle,
// which every lane must reach for every (s, i): nothing before the call depends on the data.
ZPP_HD int rotation_stages(int log2h) { return log2h > 3 ? log2h - 2 : 1; }

template <int V, typename Partner>
ZPP_HD void lane_rotation_stage(float (&v)[V][kChunk], int64_t n, int lane, int lanes, int log2h, int st,
                                Partner partner) {
  if (st == 0) {
ZPP_UNROLL
    for (int s = 0; s < V; ++s) chunk_stages(v[s], (lane + int64_t(s) * lanes) * kChunk, n, log2h);
    return;
  }
  const int64_t dc = int64_t(1) << (st - 1);
  if (dc >= lanes) return lane_slot_stage<V>(v, n, lane, lanes, dc, log2h);
ZPP_UNROLL
  for (int s = 0; s < V; ++s) {
    const int64_t c = lane + int64_t(s) * lanes;
ZPP_UNROLL
    for (int i = 0; i < kChunk; ++i) {
      const float p = partner(s, i, dc);
      v[s][i] = cross_chunk_value(v[s][i], p, c, n, dc, log2h);
    }
  }
}

template <int V>
ZPP_HD void lane_rotation_scale(float (&v)[V][kChunk], int64_t n, int lane, int lanes, int log2h) {
ZPP_UNROLL
  for (int s = 0; s < V; ++s) chunk_run_scale(v[s], (lane + int64_t(s) * lanes) * kChunk, n, log2h);
}

// The elementwise kernels' thread -> chunk map with rows padded to whole runs of rc = max(1, h / 8)
// chunks: thread t (of a padded total) takes row t / per_row_padded, chunk t % per_row_padded.
ZPP_HD int64_t run_chunks(int log2h) { return log2h > 3 ? int64_t(1) << (log2h - 3) : 1; }
ZPP_HD int64_t padded_row_chunks(int64_t length, int log2h) {
  const int64_t rc = run_chunks(log2h);
  return ceil_div(ceil_div(length, kChunk), rc) * rc;
}

// ------------------------------------------------- sources and sinks ----
// The fused kernel's source: block j_out of output row k, values summed over the input chunks.
struct ReduceSource {
  const uint8_t* packed_in;
  int64_t chunks, rows, rb, nb_in, k, e0;
  int bits;
  int64_t block;
  ZPP_HD void load(int64_t c, int cnt, float (&v)[kChunk]) const {
    reduce_chunk(packed_in, chunks, rows, rb, nb_in, k, e0 + c * kChunk, cnt, bits, block, v);
  }
};

// Words of block k of a packed row (data = the row's data bytes, e0 = the block's first element).
struct RowSink {
  uint8_t* data;
  int64_t e0;
  int bits;
  ZPP_HD void store(int64_t c, int cnt, const uint32_t (&w)[2]) const {
    store_chunk_words(data, e0 + c * kChunk, cnt, bits, w);
  }
};

}  // namespace chunks
}  // namespace zpp
