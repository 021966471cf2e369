// The CPU kernels' loops, compiled once per instruction-set level.
//
// NO include guard on purpose: quant_cpu.cpp includes this file several times,
// each time with ZPP_CPU_ISA_NS naming a namespace of its own and, for the x86-64
// levels above the baseline, inside `#pragma GCC target(...)`, so one portable
// build carries an SSE2 baseline plus AVX2 and AVX-512 versions of every hot loop
// and picks one at run time (quant_cpu.cpp). Only functions *defined* here get
// the level's instructions: the headers are included by quant_cpu.cpp before
// any pragma, and GCC compiles a template with the options in force where the
// template is defined, so no inline function or template instance shared with
// other code (c10, std::vector, at::parallel_for) is ever compiled for a CPU
// that may lack the instructions.
//
// The bits produced are the same at every level: the loops use IEEE float
// add/mul/div only (the AVX2 quantize loop multiplies by the reciprocal only where
// that provably gives the division's code: quant_cpu_avx2.h, ReciprocalCodes; no
// FMA: -ffp-contract=off applies to every level, and tests/test_kernels.py
// disassembles the extension to check), and the
// fp16 <-> fp32 conversions (F16C instructions or c10's software path) are both
// correctly rounded. tests/test_kernels.py checks every level against the
// reference.
//
// Expects: ZPP_CPU_ISA_NS (namespace name), ZPP_CPU_ISA_F16C (0/1: may use F16C),
// ZPP_CPU_ISA_AVX2 (0/1: may use AVX2; the hand-written loops of quant_cpu_avx2.h), ZPP_CPU_ISA_AVX512
// (0/1: may use AVX-512 F/BW/DQ/VL; the 16-lane loops of quant_cpu_avx512.h, with AVX2 set too).
// Defines zpp::ZPP_CPU_ISA_NS::{quantize_rows, dequantize_rows,
// dequant_reduce_quantize, dequant_reduce} (see CpuKernels in quant_cpu.cpp).

namespace zpp {
namespace ZPP_CPU_ISA_NS {
namespace {

#if ZPP_CPU_ISA_AVX2
#include "quant_cpu_avx2.h"
#endif
// The rotation, the whole-block quantize loop and the fused ops' sums over chunks at the level's widest
// vectors: 16 lanes at x86-64-v4 (quant_cpu_avx512.h), else 8; the other loops stay at 8 lanes.
#if ZPP_CPU_ISA_AVX512
#include "quant_cpu_avx512.h"
namespace wide = avx512;
#elif ZPP_CPU_ISA_AVX2
namespace wide = avx2;
#endif

// hadamard_range with the level's fastest run (AVX2 for runs of 8 or more); same bits.
inline void hadamard_range_fast(float* v, int64_t n, int log2h) {
#if ZPP_CPU_ISA_AVX2
  if (avx2::rotate_applies(n, log2h)) return wide::rotate(v, n, log2h, v);
  if (log2h >= 3) {
    const int64_t h = int64_t(1) << log2h;
    for (int64_t r = 0; r + h <= n; r += h) avx2::hadamard_run(v + r, log2h);
    return;
  }
#endif
  hadamard_range(v, n, log2h);
}

template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T from_f32(float v) {
  return static_cast<T>(v);  // c10::BFloat16 / c10::Half round to nearest even, as torch does
}
#if ZPP_CPU_ISA_F16C
// The F16C instructions, as c10::Half itself uses when the whole build targets F16C.
template <>
inline float to_f32(c10::Half v) {
  return _cvtsh_ss(v.x);
}
template <>
inline c10::Half from_f32(float v) {
  return c10::Half(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT), c10::Half::from_bits());
}
#endif

// ---- 16-bit inputs: widened a block at a time, then the fp32 loops ----
// Converting per element inside quantize_block converts every value twice
// (absmax pass, quantize pass) and keeps the fp16 loops scalar (one F16C
// instruction or c10 software call per value). Instead a bf16/fp16 input block
// is widened once into an fp32 buffer and quantized by the same code as fp32
// input; fp32 input is read in place (Widened<float> hands back the pointer,
// no copy). Widening is exact (bf16 is the high half of an fp32; F16C and c10
// convert fp16 exactly), so the bits are those of the per-element conversion.
inline void widen(const c10::BFloat16* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {  // vectorizes to shifts
    const uint32_t b = static_cast<uint32_t>(x[i].x) << 16;
    std::memcpy(out + i, &b, 4);
  }
}
inline void widen(const c10::Half* x, int64_t n, float* out) {
  int64_t i = 0;
#if ZPP_CPU_ISA_F16C
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = to_f32(x[i]);  // F16C: vcvtph2ps; baseline: c10's software conversion
}

// (Sized on first use, not from `block`: the fp32 instance then touches nothing
// new, and its task lambda compiles as before.)
template <typename T>
struct Widened {  // bf16 / fp16: an fp32 buffer for one block, per task
  std::vector<float> buf;
  const float* operator()(const T* x, int64_t n) {
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    widen(x, n, buf.data());
    return buf.data();
  }
};
template <>
struct Widened<float> {  // fp32: used in place
  const float* operator()(const float* x, int64_t) { return x; }
};

// Hadamard smoothing (quant_math.h hadamard_range): a block's values widened into
// a per-task fp32 buffer (fp32 copied) and rotated there, every dtype alike.
template <typename T>
struct Rotated {
  std::vector<float> buf;
  // ahead: the rotation's prefetch distance (avx2::rotate; kQuantizeAheadBytes), 0 for none.
  float* operator()(const T* x, int64_t n, int log2h, [[maybe_unused]] int64_t ahead = 0) {
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
#if ZPP_CPU_ISA_AVX2
    if (avx2::rotate_applies(n, log2h)) {  // widened and rotated in registers, one pass
      wide::rotate(x, n, log2h, buf.data(), ahead);
      return buf.data();
    }
#endif
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(buf.data(), x, n * sizeof(float));
    } else {
      widen(x, n, buf.data());
    }
    hadamard_range_fast(buf.data(), n, log2h);
    return buf.data();
  }
};

#if ZPP_CPU_ISA_F16C
// ---- fp16 outputs at the F16C levels: narrowed straight from registers ----
// from_f32<c10::Half> is one scalar vcvtps2ph per value and keeps the decode
// loop scalar. These compute eight values in a vector register and narrow them
// with one vcvtps2ph, no fp32 staging buffer. Same bits: int -> float is exact,
// _mm256_mul_ps / _mm256_div_ps are the IEEE fp32 mul / div of f32_mul /
// f32_div (no FMA), and the immediate fixes round-to-nearest-even. bf16 outputs
// keep the per-element from_f32 (c10's round-to-nearest-even), which the
// compiler already vectorizes.
constexpr int kHalfNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline void store_half8(c10::Half* y, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_cvtps_ph(v, kHalfNearest));
}

// y[0..n) = decoded elements [e0, e0+n) of one block (e0 is a block start: even).
inline void decode_to_half(const uint8_t* data, int64_t e0, int64_t n, int bits, float s, c10::Half* y) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  if (bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(data) + e0;
    for (; i + 8 <= n; i += 8) {
      const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      store_half8(y + i, _mm256_mul_ps(_mm256_cvtepi32_ps(v), sv));
    }
    for (; i < n; ++i) y[i] = from_f32<c10::Half>(f32_mul(static_cast<float>(q[i]), s));
  } else {
    const uint8_t* q = data + e0 / 2;
    // Elements i..i+7 are the nibbles of one little-endian 32-bit word, element
    // i+j at bits 4j..4j+3: shift each to the top of its lane, then shift back
    // arithmetically (sign-extends as unpack_int4_lo/hi do).
    const __m256i to_top = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    for (; i + 8 <= n; i += 8) {
      uint32_t w;
      std::memcpy(&w, q + i / 2, 4);
      const __m256i v = _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(static_cast<int>(w)), to_top), 28);
      store_half8(y + i, _mm256_mul_ps(_mm256_cvtepi32_ps(v), sv));
    }
    for (; i + 2 <= n; i += 2) {
      y[i] = from_f32<c10::Half>(f32_mul(static_cast<float>(unpack_int4_lo(q[i / 2])), s));
      y[i + 1] = from_f32<c10::Half>(f32_mul(static_cast<float>(unpack_int4_hi(q[i / 2])), s));
    }
    if (i < n) y[i] = from_f32<c10::Half>(f32_mul(static_cast<float>(unpack_int4_lo(q[i / 2])), s));
  }
}

// y[0..n) = acc[0..n) / divisor.
inline void divide_to_half(const float* acc, int64_t n, float divisor, c10::Half* y) {
  const __m256 dv = _mm256_set1_ps(divisor);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_half8(y + i, _mm256_div_ps(_mm256_loadu_ps(acc + i), dv));
  for (; i < n; ++i) y[i] = from_f32<c10::Half>(f32_div(acc[i], divisor));
}
#endif

// Each parallel task gets at least this many elements: enough to amortize the
// task start, small enough to balance blocks over two or more threads.
constexpr int64_t kGrainElements = 1 << 15;

// quantize's prefetch distance at x86-64-v3 (quantize_rows_kernel): the first pass over a step's input asks for the
// line this far past each group of 32 values it reads. Software prefetch at all because, on an AVX2-only AMD Zen 3
// VM, the hardware prefetcher alone left quantize INT4 and INT8 bf16 10-20% slower on cold inputs of 16M values, and
// the Hadamard quantize lower in 7 of 8 rows (docs/bench/2026-12-01-codecs-ceiling, the variant without it). This
// distance and spread because the earlier scheme, the whole next step asked for at the step's start, looked only
// one step ahead: 2 KiB for INT4 bf16 at block 128, 8 KiB for INT8 fp32 at block 256.
// Against a build of that scheme (f0bcace; 2 threads, cold inputs of 16M / 64M values, medians of 4 alternating
// rounds) the Hadamard quantize of fp32 runs 12-28% faster (INT8 0.52 / 0.50x memcpy -> 0.63 / 0.64, INT4 0.51 / 0.51
// -> 0.57 / 0.61) and quantize INT4 bf16 at 64M 17% (0.48 -> 0.56); the other rows are not resolved either way
// (docs/bench/2026-12-02-quantize-prefetch). Of 2048, 4096, 8192 and 16384 bytes, 4096 to 16384 measured alike
// within the rounds' spread and 2048 lower for the rotated fp32 quantize; max(4096, one step) no better.
constexpr int64_t kQuantizeAheadBytes = 4096;

inline int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, kGrainElements / block); }

inline void store_scale(uint8_t* row, int64_t k, float scale) { std::memcpy(row + 4 * k, &scale, 4); }
inline float load_scale(const uint8_t* row, int64_t k) {
  float s;
  std::memcpy(&s, row + 4 * k, 4);
  return s;
}

// absmax over n values and whether any was NaN/Inf, on the bit patterns of
// |v|: non-negative IEEE floats order like their bits, and bits >= 0x7f800000
// (exponent all ones) means Inf or NaN. Integer max vectorizes cleanly and runs
// ~2.7x faster here than a float max plus a separate NaN check.
template <typename T>
inline float block_absmax(const T* x, int64_t n, bool* nonfinite) {
  constexpr int V = 16;
  uint32_t mx[V] = {0};
  int64_t i = 0;
  for (; i + V <= n; i += V) {
    for (int j = 0; j < V; ++j) {
      const float v = to_f32(x[i + j]);
      uint32_t b;
      std::memcpy(&b, &v, 4);
      b &= 0x7fffffffu;
      mx[j] = mx[j] > b ? mx[j] : b;
    }
  }
  uint32_t m = 0;
  for (; i < n; ++i) {
    const float v = to_f32(x[i]);
    uint32_t b;
    std::memcpy(&b, &v, 4);
    b &= 0x7fffffffu;
    m = m > b ? m : b;
  }
  for (int j = 0; j < V; ++j) m = m > mx[j] ? m : mx[j];
  *nonfinite = m >= 0x7f800000u;
  float r;
  std::memcpy(&r, &m, 4);
  return r;
}

// Quantize one block of n <= block values: writes its scale and ceil(n*bits/8) data bytes.
// kN > 0 fixes n at compile time (full blocks of common sizes): the loops then
// have constant trip counts and no vector prologue/epilogue, which is worth ~10%
// at block=256 where per-block overhead is a sizable share of the work.
// kInt4Runs (16-bit inputs only, on their widened fp32 block): INT4 with
// nearest rounding quantizes a run with the contiguous INT8 loop, then packs
// byte pairs, instead of pairing x[2p], x[2p+1] (stride-2 loads need shuffles).
// fp32 inputs keep the pair loop.
template <int64_t kN = 0, bool kInt4Runs = false, typename T>
inline void quantize_block(const T* __restrict__ x, int64_t n_runtime, int bits, bool stochastic, uint64_t seed,
                           uint64_t index0, float* scale_out, uint8_t* __restrict__ data) {
  const int64_t n = kN > 0 ? kN : n_runtime;
  const int qmax = qmax_for_bits(bits);
  bool nonfinite = false;
  const float absmax = block_absmax(x, n, &nonfinite);
  const float scale = block_scale(absmax, nonfinite, qmax);
  *scale_out = scale;
  const int64_t nbytes = ceil_div(n * bits, 8);
  if (!scale_is_usable(scale)) {  // zero block (exact) or non-finite block (decodes NaN)
    std::memset(data, 0, nbytes);
    return;
  }
  const float fq = static_cast<float>(qmax);
  if (bits == 8) {
    int8_t* q = reinterpret_cast<int8_t*>(data);
    if (stochastic) {
      for (int64_t i = 0; i < n; ++i)
        q[i] = static_cast<int8_t>(
            quantize_stochastic_unchecked(to_f32(x[i]), scale, fq, stochastic_uniform(seed, index0 + i)));
    } else {
      for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(quantize_nearest_unchecked(to_f32(x[i]), scale, fq));
    }
    return;
  }
  const int64_t pairs = n / 2;
  if (stochastic) {
    for (int64_t p = 0; p < pairs; ++p) {
      const int lo = quantize_stochastic_unchecked(to_f32(x[2 * p]), scale, fq, stochastic_uniform(seed, index0 + 2 * p));
      const int hi =
          quantize_stochastic_unchecked(to_f32(x[2 * p + 1]), scale, fq, stochastic_uniform(seed, index0 + 2 * p + 1));
      data[p] = pack_int4(lo, hi);
    }
  } else if constexpr (kInt4Runs) {
    constexpr int64_t kRun = 256;
    int8_t run[kRun];
    for (int64_t r0 = 0; r0 < 2 * pairs; r0 += kRun) {
      const int64_t len = std::min(kRun, 2 * pairs - r0);
      for (int64_t i = 0; i < len; ++i)
        run[i] = static_cast<int8_t>(quantize_nearest_unchecked(to_f32(x[r0 + i]), scale, fq));
      for (int64_t p = 0; p < len / 2; ++p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        uint16_t w;  // run[2p] in the low byte: pack_int4(run[2p], run[2p+1]) without a byte shuffle
        std::memcpy(&w, run + 2 * p, 2);
        data[r0 / 2 + p] = static_cast<uint8_t>((w & 0x0fu) | ((w >> 4) & 0xf0u));
#else
        data[r0 / 2 + p] = pack_int4(run[2 * p], run[2 * p + 1]);
#endif
      }
    }
  } else {
    for (int64_t p = 0; p < pairs; ++p) {
      const int lo = quantize_nearest_unchecked(to_f32(x[2 * p]), scale, fq);
      const int hi = quantize_nearest_unchecked(to_f32(x[2 * p + 1]), scale, fq);
      data[p] = pack_int4(lo, hi);
    }
  }
  if (n % 2) {  // odd tail (only in a row's last block): high nibble stays 0
    const float v = to_f32(x[n - 1]);
    const int lo = stochastic ? quantize_stochastic_unchecked(v, scale, fq, stochastic_uniform(seed, index0 + n - 1))
                              : quantize_nearest_unchecked(v, scale, fq);
    data[pairs] = pack_int4(lo, 0);
  }
}

// Quantize one block with the level's vector loop (quant_cpu_avx2.h) where it applies: nearest
// rounding and n a multiple of 32. Returns false (writing nothing) where it does not; the caller then
// runs quantize_block. Same bytes and scale as quantize_block.
template <typename T>
inline bool quantize_block_fast(const T* x, int64_t n, int bits, bool stochastic, float* scale_out, uint8_t* data) {
#if ZPP_CPU_ISA_AVX2
  if (stochastic || n % 32 != 0) return false;
  wide::quantize_full_blocks(x, 1, n, bits, reinterpret_cast<uint8_t*>(scale_out), data);  // one block of n
  return true;
#else
  (void)x, (void)n, (void)bits, (void)stochastic, (void)scale_out, (void)data;
  return false;
#endif
}

template <bool kInt4Runs = false, typename T>
inline void quantize_block_dispatch(const T* x, int64_t n, int64_t block, int bits, bool stochastic, uint64_t seed,
                                    uint64_t index0, float* scale, uint8_t* data) {
  if (n == block) {
    switch (block) {
      case 64: return quantize_block<64, kInt4Runs>(x, n, bits, stochastic, seed, index0, scale, data);
      case 128: return quantize_block<128, kInt4Runs>(x, n, bits, stochastic, seed, index0, scale, data);
      case 256: return quantize_block<256, kInt4Runs>(x, n, bits, stochastic, seed, index0, scale, data);
      case 512: return quantize_block<512, kInt4Runs>(x, n, bits, stochastic, seed, index0, scale, data);
      case 1024: return quantize_block<1024, kInt4Runs>(x, n, bits, stochastic, seed, index0, scale, data);
      case 2048: return quantize_block<2048, kInt4Runs>(x, n, bits, stochastic, seed, index0, scale, data);
      case 4096: return quantize_block<4096, kInt4Runs>(x, n, bits, stochastic, seed, index0, scale, data);
      default: break;
    }
  }
  quantize_block<0, kInt4Runs>(x, n, bits, stochastic, seed, index0, scale, data);
}

// Quantize R rows of L elements of x into packed rows; row r goes to row_map(r).
// bf16/fp16 blocks are widened to fp32 first (Widened); fp32 is read in place.
template <typename T, typename RowMap>
void quantize_rows_kernel(const T* x, uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block,
                          bool stochastic, uint64_t seed, int log2h, RowMap row_map) {
  const int64_t nb = num_blocks(length, block);
  const int64_t rb = row_bytes(length, bits, block);
  const int64_t used = ceil_div(length * bits, 8);
  const int64_t padded = data_bytes(length, bits);
  at::parallel_for(0, rows * nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    Widened<T> widened;  // (not `wide`: that names the vector loops' namespace)
    Rotated<T> rotated;
    // Walk (row, block) incrementally: a 64-bit division per block costs as
    // much as quantizing a quarter of a 256-element block.
    int64_t r = b0 / nb, k = b0 % nb;
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* row = packed + row_map(r) * rb;
      uint8_t* data = row + 4 * nb;
#if ZPP_CPU_ISA_AVX2
      // Up to 8 full blocks of this row at once (quantize_full_blocks), rotated first with Hadamard
      // smoothing. Full blocks end on a multiple of 32 values: no data padding to zero.
      if (!stochastic && block % 32 == 0 && (!log2h || avx2::rotate_applies(block, log2h))) {
        const int64_t g = std::min<int64_t>({8, length / block - k, b1 - b});
        if (g > 0) {
          const T* src = x + r * length + k * block;
          // The first pass over the input (the absmax, or the rotation) asks for the line kQuantizeAheadBytes
          // past each group of 32 values it reads (a hint: it never faults past the end). x86-64-v4's loops
          // take the distance and ignore it: no software prefetch there, where it is unmeasured.
          const int64_t ahead = kQuantizeAheadBytes;
          if (log2h) {
            wide::quantize_full_blocks(rotated(src, g * block, log2h, ahead), g, block, bits, row + 4 * k,
                                       data + k * block * bits / 8);
          } else {
            wide::quantize_full_blocks(src, g, block, bits, row + 4 * k, data + k * block * bits / 8, ahead);
          }
          b += g - 1;
          k += g;
          if (k == nb) {
            k = 0;
            ++r;
          }
          continue;
        }
      }
#endif
      const int64_t e0 = k * block;
      const int64_t n = std::min(block, length - e0);
      float scale;
      if (log2h) {
        // Hadamard smoothing: the block's fp32 values rotated in a per-task copy, then the
        // widened-block code (runs start at block starts: h divides the block).
        float* v = rotated(x + r * length + e0, n, log2h);
        if (!quantize_block_fast(v, n, bits, stochastic, &scale, data + e0 * bits / 8))
          quantize_block_dispatch<true>(v, n, block, bits, stochastic, seed, static_cast<uint64_t>(r * length + e0),
                                        &scale, data + e0 * bits / 8);
      } else if (quantize_block_fast(x + r * length + e0, n, bits, stochastic, &scale, data + e0 * bits / 8)) {
        // 16-bit inputs widened in registers, no staging buffer
      } else {
        quantize_block_dispatch<!std::is_same_v<T, float>>(widened(x + r * length + e0, n), n, block, bits, stochastic,
                                                           seed, static_cast<uint64_t>(r * length + e0), &scale,
                                                           data + e0 * bits / 8);
      }
      store_scale(row, k, scale);
      if (k == nb - 1 && padded > used) std::memset(data + used, 0, padded - used);
      if (++k == nb) {
        k = 0;
        ++r;
      }
    }
  });
}

// acc[0..n) += dequantized elements [e0, e0+n) of one packed row (fp32, mul then add).
inline void accumulate_row_range(const uint8_t* row, int64_t length, int bits, int64_t block, int64_t e0, int64_t n,
                                 float* acc) {
  const int64_t nb = num_blocks(length, block);
  const uint8_t* data = row + 4 * nb;
  int64_t e = e0;
  const int64_t end = e0 + n;
  while (e < end) {
    const int64_t k = e / block;
    const int64_t stop = std::min(end, (k + 1) * block);
    const float s = load_scale(row, k);
    float* a = acc + (e - e0);
    const int64_t m = stop - e;
    if (bits == 8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(data) + e;
      for (int64_t i = 0; i < m; ++i) a[i] = f32_add(a[i], f32_mul(static_cast<float>(q[i]), s));
    } else {
      // e is even: block boundaries are multiples of 8 and e0 is a block start.
      const uint8_t* q = data + e / 2;
      const int64_t pairs = m / 2;
      for (int64_t p = 0; p < pairs; ++p) {
        a[2 * p] = f32_add(a[2 * p], f32_mul(static_cast<float>(unpack_int4_lo(q[p])), s));
        a[2 * p + 1] = f32_add(a[2 * p + 1], f32_mul(static_cast<float>(unpack_int4_hi(q[p])), s));
      }
      if (m % 2) a[m - 1] = f32_add(a[m - 1], f32_mul(static_cast<float>(unpack_int4_lo(q[pairs])), s));
    }
    e = stop;
  }
}

// y[0..n) = decoded fp32 elements [e0, e0+n) of one block (e0 is a block start: even).
inline void decode_block(const uint8_t* data, int64_t e0, int64_t n, int bits, float s, float* y) {
#if ZPP_CPU_ISA_AVX2
  if (n % 8 == 0 && e0 % 8 == 0) return avx2::decode(data, e0, n, bits, s, y);
#endif
  if (bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(data) + e0;
    for (int64_t i = 0; i < n; ++i) y[i] = f32_mul(static_cast<float>(q[i]), s);
    return;
  }
  const uint8_t* q = data + e0 / 2;
  const int64_t pairs = n / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    y[2 * p] = f32_mul(static_cast<float>(unpack_int4_lo(q[p])), s);
    y[2 * p + 1] = f32_mul(static_cast<float>(unpack_int4_hi(q[p])), s);
  }
  if (n % 2) y[n - 1] = f32_mul(static_cast<float>(unpack_int4_lo(q[pairs])), s);
}

// accumulate: out = cast(decoded + fp32(out)), one rounding (qWD's decode-and-add of weight differences).
template <typename T>
void dequantize_rows_kernel(const uint8_t* packed, T* out, int64_t rows, int64_t length, int bits, int64_t block,
                            int log2h, bool accumulate) {
  const int64_t nb = num_blocks(length, block);
  const int64_t rb = row_bytes(length, bits, block);
  at::parallel_for(0, rows * nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    std::vector<float> rot;  // Hadamard smoothing only: the decoded block, rotated back in fp32
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / nb, k = b % nb;
      const uint8_t* row = packed + r * rb;
      const uint8_t* data = row + 4 * nb;
      const float s = load_scale(row, k);
      const int64_t e0 = k * block;
      const int64_t n = std::min(block, length - e0);
      T* y = out + r * length + e0;
      if (log2h || accumulate) {
        rot.resize(n);
        decode_block(data, e0, n, bits, s, rot.data());
        if (log2h) hadamard_range_fast(rot.data(), n, log2h);
        if (accumulate) {
          for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(f32_add(rot[i], to_f32(y[i])));
        } else {
          for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(rot[i]);
        }
        continue;
      }
#if ZPP_CPU_ISA_F16C
      if constexpr (std::is_same_v<T, c10::Half>) {
        decode_to_half(data, e0, n, bits, s, y);
        continue;
      }
#endif
      if (bits == 8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(data) + e0;
        for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(f32_mul(static_cast<float>(q[i]), s));
      } else {
        const uint8_t* q = data + e0 / 2;
        const int64_t pairs = n / 2;
        for (int64_t p = 0; p < pairs; ++p) {
          y[2 * p] = from_f32<T>(f32_mul(static_cast<float>(unpack_int4_lo(q[p])), s));
          y[2 * p + 1] = from_f32<T>(f32_mul(static_cast<float>(unpack_int4_hi(q[p])), s));
        }
        if (n % 2) y[n - 1] = from_f32<T>(f32_mul(static_cast<float>(unpack_int4_lo(q[pairs])), s));
      }
    }
  });
}

// Sum over the C chunks of packed_in [C, K, rb] for output blocks of `block_out` elements, handing the fp32
// sums of up to sum_blocks(block_out) consecutive output blocks of one row to `emit(k, j, e0, n, acc)`: row k, first block
// j, elements [e0, e0 + n) (acc is the task's buffer: emit may transform it in place). Several blocks at a
// time because the per-block work besides the sums (the row and block indices, the chunks' row pointers, the
// output scales' divisions) measured as much as the sums themselves for INT4 at block 128: 4 chunks at 11
// GB/s at block 128 against 20 at block 512.
constexpr int64_t kSumElements = 4096;  // acc of up to 16 KiB: stays in L1
inline int64_t sum_blocks(int64_t block_out) { return std::clamp<int64_t>(kSumElements / block_out, 1, 8); }

template <typename Emit>
void reduce_chunks(const uint8_t* base, int64_t chunks, int64_t rows, int64_t rb, int64_t length, int bits_in,
                   int64_t block_in, int64_t block_out, Emit emit) {
  const int64_t nb = num_blocks(length, block_out);
  const int64_t per_step = sum_blocks(block_out);
  at::parallel_for(0, rows * nb, grain_blocks(block_out), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(per_step * block_out);
#if ZPP_CPU_ISA_AVX2
    std::vector<const uint8_t*> row_ptrs(chunks);
#endif
    int64_t k = b0 / nb, j = b0 % nb;  // walked incrementally: no division per step
    for (int64_t b = b0; b < b1;) {
      const int64_t g = std::min({per_step, nb - j, b1 - b});
      const int64_t e0 = j * block_out;
      const int64_t n = std::min(g * block_out, length - e0);
#if ZPP_CPU_ISA_AVX2
      if (block_in % 8 == 0 && block_out % 8 == 0 && n % 8 == 0) {
        for (int64_t c = 0; c < chunks; ++c) row_ptrs[c] = base + (c * rows + k) * rb;
        wide::reduce_rows(row_ptrs.data(), chunks, length, bits_in, block_in, e0, n, acc.data());
      } else
#endif
      {
        std::fill(acc.begin(), acc.begin() + n, 0.0f);
        for (int64_t c = 0; c < chunks; ++c)  // fixed chunk order, as in the reference
          accumulate_row_range(base + (c * rows + k) * rb, length, bits_in, block_in, e0, n, acc.data());
      }
      emit(k, j, e0, n, acc.data());
      b += g;
      j += g;
      if (j == nb) {
        j = 0;
        ++k;
      }
    }
  });
}

template <typename Fn>
void dispatch_dtype(CpuDtype dtype, Fn fn) {
  switch (dtype) {
    case CpuDtype::kFloat32: return fn(static_cast<float*>(nullptr));
    case CpuDtype::kBFloat16: return fn(static_cast<c10::BFloat16*>(nullptr));
    case CpuDtype::kFloat16: return fn(static_cast<c10::Half*>(nullptr));
  }
}

// ---------------------------------------------------- entry points ----------
void quantize_rows(const void* x, CpuDtype dtype, uint8_t* packed, int64_t rows, int64_t length, int bits,
                   int64_t block, bool stochastic, uint64_t seed, int log2h, const RowReorder* reorder) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xt = static_cast<const T*>(x);
    if (reorder) {
      const RowReorder ro = *reorder;
      quantize_rows_kernel(xt, packed, rows, length, bits, block, stochastic, seed, log2h, [ro](int64_t r) {
        return reorder_slot_of_input_row(r, ro.stages, ro.node_size, ro.nodes);
      });
    } else {
      quantize_rows_kernel(xt, packed, rows, length, bits, block, stochastic, seed, log2h,
                           [](int64_t r) { return r; });
    }
  });
}

void dequantize_rows(const uint8_t* packed, void* out, CpuDtype dtype, int64_t rows, int64_t length, int bits,
                     int64_t block, int log2h, bool accumulate) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dequantize_rows_kernel(packed, static_cast<T*>(out), rows, length, bits, block, log2h, accumulate);
  });
}

void dequant_reduce_quantize(const uint8_t* packed_in, uint8_t* packed_out, int64_t chunks, int64_t rows,
                             int64_t row_numel, int bits_in, int64_t block_in, int bits_out, int64_t block_out,
                             bool stochastic, uint64_t seed, int log2h_in, int log2h_out) {
  const int64_t rb_in = row_bytes(row_numel, bits_in, block_in);
  const int64_t nb_out = num_blocks(row_numel, block_out);
  const int64_t rb_out = row_bytes(row_numel, bits_out, block_out);
  const int64_t used = ceil_div(row_numel * bits_out, 8), padded = data_bytes(row_numel, bits_out);
  reduce_chunks(packed_in, chunks, rows, rb_in, row_numel, bits_in, block_in, block_out,
                [&](int64_t k, int64_t j0, int64_t e0, int64_t n, float* acc) {
                  // Rotated in and out alike: the sum stays in the rotated domain (the transform is
                  // linear and its own inverse), so neither is applied. (Runs start at block starts: h
                  // divides both blocks, so n values from a block start rotate as their blocks would.)
                  if (log2h_in != log2h_out) {
                    if (log2h_in) hadamard_range_fast(acc, n, log2h_in);
                    if (log2h_out) hadamard_range_fast(acc, n, log2h_out);
                  }
                  uint8_t* row = packed_out + k * rb_out;
                  uint8_t* data = row + 4 * nb_out;
                  int64_t done = 0;
#if ZPP_CPU_ISA_AVX2
                  // The full blocks at once: their scales' divisions as one vector division.
                  if (!stochastic && block_out % 32 == 0 && n >= block_out) {
                    done = n / block_out * block_out;
                    wide::quantize_full_blocks(acc, n / block_out, block_out, bits_out, row + 4 * j0,
                                               data + e0 * bits_out / 8);
                  }
#endif
                  for (int64_t off = done; off < n; off += block_out) {
                    const int64_t m = std::min(block_out, n - off), e = e0 + off;
                    float scale;
                    if (!quantize_block_fast(acc + off, m, bits_out, stochastic, &scale, data + e * bits_out / 8))
                      quantize_block_dispatch(acc + off, m, block_out, bits_out, stochastic, seed,
                                              static_cast<uint64_t>(k * row_numel + e), &scale,
                                              data + e * bits_out / 8);
                    store_scale(row, j0 + off / block_out, scale);
                  }
                  if (e0 + n == row_numel && padded > used) std::memset(data + used, 0, padded - used);
                });
}

void dequant_reduce(const uint8_t* packed_in, void* out, CpuDtype dtype, int64_t chunks, int64_t rows,
                    int64_t length, int bits, int64_t block, float divisor, int log2h) {
  const int64_t rb = row_bytes(length, bits, block);
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* y = static_cast<T*>(out);
    reduce_chunks(packed_in, chunks, rows, rb, length, bits, block, block,
                  [&](int64_t k, int64_t, int64_t e0, int64_t n, float* acc) {
                    // Rows rotated on the way in: the fp32 sum is rotated back once (linearity).
                    if (log2h) hadamard_range_fast(acc, n, log2h);
                    T* dst = y + k * length + e0;
#if ZPP_CPU_ISA_F16C
                    if constexpr (std::is_same_v<T, c10::Half>) {
                      divide_to_half(acc, n, divisor, dst);
                      return;
                    }
#endif
                    for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<T>(f32_div(acc[i], divisor));
                  });
  });
}

}  // namespace
}  // namespace ZPP_CPU_ISA_NS
}  // namespace zpp
