// Index, packing and rounding math shared by the C++ (CPU) and CUDA kernels.
//
// Everything that decides *which bits* end up on the wire lives here, so the CPU
// kernels (tested on every CI run) and the CUDA kernels (compiled in CI, run on
// GPU machines) cannot drift apart. The pure-PyTorch reference in
// megatron_zpp/compression/reference.py implements the same rules and is the
// test oracle; docs/format: megatron_zpp/compression/blockwise.md.
//
// Numerics contract (all float32, no FMA contraction anywhere: CPU sources are
// built with -ffp-contract=off and device code uses the _rn intrinsics):
//   absmax  = max |x| over the block (partial last block: over its valid elements)
//   scale   = absmax / qmax                     (stored, fp32; block_scale below)
//   block has a NaN/Inf element -> scale = NaN, every q = 0  (decodes as NaN)
//   q       = scale > 0 ? clamp(round(x / scale), -qmax, qmax) : 0
//             round = nearest-even, or floor(v + u) with u in [0,1) from the
//             counter-based hash below (stochastic rounding)
//   decode  = q * scale, then cast to the output dtype (round-to-nearest-even)
//   reduce  = acc = 0; for c in chunks: acc = acc + q_c * scale_c  (chunk order)
//   mean    = acc / float(divisor), then cast to the output dtype (dequant_reduce_)
//
// Every "/" above is ONE IEEE-754 fp32 division, correctly rounded (f32_div):
// never a multiply by a reciprocal. absmax * (1.0f / qmax) differs from
// absmax / qmax in the last bit for a few percent of INT8 and about half of
// INT4 blocks, and the scale is on the wire, so this is the one definition that
// every implementation computes:
//   C++ (CPU)   `a / b`, vectorized to IEEE div instructions (SSE/AVX/NEON);
//               never built with -ffast-math / -freciprocal-math. The AVX2 quantize
//               loop (csrc/cpu/quant_cpu_avx2.h, ReciprocalCodes) multiplies by the
//               reciprocal only where the rounded code provably equals that of the
//               quotient, and divides everywhere else; INT4 codes of 16-bit values
//               come from comparisons with the block's exact code boundaries
//               (Int4Thresholds): the codes are the contract's.
//   CUDA        __fdiv_rn(a, b).
//   reference   tensor / tensor on the same device. NOT tensor / Python number:
//               PyTorch's CUDA kernel computes that as a * (1.0f / b).
//               tests/test_kernels.py replays the reference with CUDA's rule on
//               CPU and requires it to still match the C++ kernels bit for bit.
#pragma once

#if defined(__FAST_MATH__)
#error "zpp/quant_math.h: -ffast-math changes rounding (reciprocal division, contraction); the kernels must match the reference bit for bit"
#endif

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define ZPP_HD __host__ __device__ __forceinline__
#else
#define ZPP_HD inline
#endif

namespace zpp {

// ---------------------------------------------------------------- layout ----
// A "row" is the packed form of L consecutive elements:
//   [ float32 scales x num_blocks(L) | data bytes, zero-padded to 4 bytes ]
// Rows of equal L are stacked as uint8[R][row_bytes(L)]; row_bytes is a
// multiple of 4, so every row's scales are 4-byte aligned.

ZPP_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
ZPP_HD int64_t align4(int64_t n) { return (n + 3) & ~int64_t(3); }
ZPP_HD int qmax_for_bits(int bits) { return bits == 8 ? 127 : 7; }
ZPP_HD int64_t num_blocks(int64_t numel, int64_t block) { return ceil_div(numel, block); }
ZPP_HD int64_t data_bytes(int64_t numel, int bits) { return align4(ceil_div(numel * bits, 8)); }
ZPP_HD int64_t row_bytes(int64_t numel, int bits, int64_t block) {
  return 4 * num_blocks(numel, block) + data_bytes(numel, bits);
}

// --------------------------------------------------- qgZ slice reordering ----
// ZeRO++ Algorithm 2 (generalized tensor slice reordering). W = node_size*nodes
// devices; a gradient buffer is cut into stages*W slices. partition_id
// enumerates (stage, destination rank) stage-major: partition_id = stage*W + p,
// with destination p = node*node_size + local. The returned slot is where that
// slice goes so that the intra-node all-to-all hands local rank `local` the
// slices of *all* nodes for its local index: slot = stage*W + local*nodes + node.
// (The paper's extracted text swaps the labels of lines 2-3; this is the reading
// that is a permutation and reproduces its Eq. (2) and Figure 9.)
ZPP_HD int64_t alg2_mapped_partition(int64_t partition_id, int64_t stages,
                                     int64_t node_size, int64_t nodes) {
  (void)stages;
  const int64_t total_devices = node_size * nodes;
  const int64_t stage_id = partition_id / total_devices;
  const int64_t chunk_id = partition_id % total_devices;
  const int64_t pipeline_offset = stage_id * total_devices;
  const int64_t chunk_offset = chunk_id / node_size;          // node of the destination
  const int64_t chunk_base = (chunk_id % node_size) * nodes;  // its local index * nodes
  return pipeline_offset + chunk_base + chunk_offset;
}

// Memory order of the input slices: slice (stage s, destination p) sits at
// input row p*stages + s, so destination p's slices are contiguous and the
// final shard of rank p is exactly what reduce_scatter_tensor would give it.
ZPP_HD int64_t reorder_slot_of_input_row(int64_t input_row, int64_t stages,
                                         int64_t node_size, int64_t nodes) {
  const int64_t total_devices = node_size * nodes;
  const int64_t dest = input_row / stages;
  const int64_t stage = input_row % stages;
  return alg2_mapped_partition(stage * total_devices + dest, stages, node_size, nodes);
}

// ------------------------------------------------------------- rounding ----
// 32-bit integer hash (Wellons' "lowbias32" constants): cheap, well mixed,
// and identical on host and device.
ZPP_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Uniform in [0, 1) with 24 bits, a pure function of (seed, element index), so
// stochastic rounding is reproducible and independent of thread scheduling.
ZPP_HD float stochastic_uniform(uint64_t seed, uint64_t index) {
  uint32_t h = mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32)));
  h = mix32(h ^ static_cast<uint32_t>(index));
  h = mix32(h ^ static_cast<uint32_t>(index >> 32));
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

ZPP_HD float f32_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ZPP_HD float f32_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ZPP_HD float f32_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Round half to even for |v| < 2^22 without a libm call: adding and removing
// 1.5*2^23 leaves the FPU's default rounding (nearest-even) to do the work.
// Vectorizes to two adds; exact for the clamped range used here.
ZPP_HD float round_nearest_even(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return f32_add(f32_add(v, magic), -magic);
}

// Scale of a block from its absmax and "saw a NaN/Inf" flag: the IEEE fp32
// quotient absmax / qmax (see the contract at the top; not a reciprocal multiply).
ZPP_HD float block_scale(float absmax, bool nonfinite, int qmax) {
  if (nonfinite) return __builtin_nanf("");
  return f32_div(absmax, static_cast<float>(qmax));
}

// Quantize one value of a block whose scale is finite and > 0 (callers check
// the block once: a zero or NaN scale means every q of the block is 0).
// Clamping before rounding equals clamping after (qmax is an integer) and keeps
// |v| small enough for round_nearest_even.
ZPP_HD int quantize_nearest_unchecked(float x, float scale, float fqmax) {
  float v = f32_div(x, scale);
  v = v > fqmax ? fqmax : v;
  v = v < -fqmax ? -fqmax : v;
  return static_cast<int>(round_nearest_even(v));
}

// Stochastic rounding: floor(v + u), u in [0, 1); unbiased. v == qmax with
// u > 0 must not round past qmax, hence the second clamp.
ZPP_HD int quantize_stochastic_unchecked(float x, float scale, float fqmax, float u) {
  float v = f32_div(x, scale);
  v = v > fqmax ? fqmax : v;
  v = v < -fqmax ? -fqmax : v;
  float r = floorf(f32_add(v, u));
  r = r > fqmax ? fqmax : r;
  return static_cast<int>(r);
}

ZPP_HD bool scale_is_usable(float scale) { return scale > 0.0f; }  // false for 0 and NaN

// --------------------------------------------------- Hadamard smoothing ----
// SDP4Bit's rotation before low-bit quantization. Each run of h = 2^log2h
// consecutive values of a row (runs start at multiples of h from the row
// start; a last run shorter than h is left as it is) is replaced by its
// normalized Walsh-Hadamard transform H_h x / sqrt(h), in natural (Sylvester)
// order. H_h / sqrt(h) is symmetric and orthogonal: the transform is its own
// inverse, up to fp32 rounding. h divides the quantization block, so a run
// never straddles two blocks. One definition of the arithmetic, everywhere:
// butterflies (a + b, a - b) at strides 1, 2, 4, ..., h/2, in that order, then
// one multiply by hadamard_scale(log2h) = fp32(1/sqrt(h)), which is a power of
// two when log2h is even and fp32(1/sqrt(2)) times one otherwise (both exact
// products). Reference: megatron_zpp/compression/reference.py, hadamard_rows.
ZPP_HD float hadamard_scale(int log2h) {
  return ldexpf((log2h & 1) ? 0.70710678118654752f : 1.0f, -(log2h >> 1));
}

ZPP_HD void hadamard_run(float* v, int log2h) {
  const int h = 1 << log2h;
  for (int d = 1; d < h; d <<= 1) {
    for (int i = 0; i < h; i += 2 * d) {
      for (int j = i; j < i + d; ++j) {
        const float a = v[j], b = v[j + d];
        v[j] = f32_add(a, b);
        v[j + d] = f32_add(a, -b);  // negation is exact: the IEEE difference a - b
      }
    }
  }
  const float s = hadamard_scale(log2h);
  for (int i = 0; i < h; ++i) v[i] = f32_mul(v[i], s);
}

// The runs of elements [e0, e0 + n) of a row of `length` elements, e0 a multiple
// of h (a block start): every full run transformed, a partial last run of the
// row untouched.
ZPP_HD void hadamard_range(float* v, int64_t n, int log2h) {
  const int64_t h = int64_t(1) << log2h;
  for (int64_t r = 0; r + h <= n; r += h) hadamard_run(v + r, log2h);
}

// -------------------------------------------------------------- packing ----
// INT8: one two's-complement byte per value. INT4: two values per byte, element
// 2i in the LOW nibble and element 2i+1 in the HIGH nibble, each a 4-bit two's
// complement number in [-7, 7] (DeepSpeed's order is the opposite; ours is the
// little-endian order most packers use). An odd tail leaves the high nibble 0.
ZPP_HD uint8_t pack_int4(int lo, int hi) {
  return static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
}
ZPP_HD int unpack_int4_lo(uint8_t b) { return static_cast<int8_t>(static_cast<uint8_t>(b << 4)) >> 4; }
ZPP_HD int unpack_int4_hi(uint8_t b) { return static_cast<int8_t>(b) >> 4; }

}  // namespace zpp
