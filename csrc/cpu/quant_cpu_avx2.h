// AVX2 loops for the hot paths of the blocked INT8/INT4 CPU kernels: nearest-rounding quantization
// of whole blocks, decoding, the fused ops' sums over chunks, and the Hadamard rotation.
//
// NO include guard: quant_cpu_isa.h includes this inside each AVX2-capable level's namespace (x86-64-v3,
// x86-64-v4), so it is compiled with that level's `#pragma GCC target`.
//
// Why by hand: GCC vectorizes the scalar loops of quant_cpu_isa.h only in part. It keeps the INT4
// pair loops and the 16-bit widening scalar, and with a runtime block length it runs the INT8
// quantize loop at about 1.5 cycles per value; tools/bench_codecs.py measured bf16 quantize at
// 0.3-0.4x memcpy that way.
//
// Same bits as the scalar code. Lane i of every vector computes the scalar expression for element i
// (zpp/quant_math.h) with the same IEEE fp32 operations in the same order: min/max clamps (no NaN
// can reach them: a block with a NaN or Inf never gets here), the 1.5 * 2^23 add/subtract rounding,
// and a truncating convert of a value that is already an integer. The one exception is the code of
// x / scale, which quantize_nearest gets from a multiply by the reciprocal and a rounding convert
// where that provably gives the same integer, and from the division itself everywhere else (the
// proof is at ReciprocalCodes); INT4 codes of 16-bit values come from a comparison with the block's
// exact code boundaries instead (Int4Thresholds; the proof is at quant_cpu_avx512.h's). Like the scalar
// code and the reference, this assumes the default rounding mode, round to nearest even (MXCSR.RC = 0; torch never changes it): under a directed
// mode the levels may differ from each other, as the reference differs from both. No FMA: -ffp-contract=off holds for
// intrinsics too, and each mul/add here is a separate intrinsic. The widenings are exact: bf16 is
// the top half of an fp32, and vcvtph2ps converts fp16 exactly. tests/test_kernels.py checks every
// level against the reference: block sizes that take these loops (multiples of 32) and ones that
// fall back to the scalar code.

namespace avx2 {

// ---- 8 input values widened to fp32 ----
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

inline uint32_t hmax_epu32(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}
inline uint32_t hmax_epu16(__m256i v) {
  __m128i m = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu16(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epu16(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  m = _mm_max_epu16(m, _mm_srli_epi32(m, 16));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m)) & 0xffffu;
}

// Asks for the cache lines of [start + from, start + to). The address is an integer: a pointer past the end of
// its buffer (where this may reach) would be undefined in C++.
inline void prefetch_bytes(uintptr_t start, int64_t from, int64_t to) {
  for (int64_t off = from; off < to; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(start + static_cast<uintptr_t>(off)), _MM_HINT_T0);
}
// The lines `ahead` bytes past the 32 values at x (a hint: never faults, past the end either).
template <typename T>
inline void prefetch_group(const T* x, int64_t ahead) {
  // (From 0 to a constant, so the loop unrolls: one or two prefetches.)
  prefetch_bytes(reinterpret_cast<uintptr_t>(x) + static_cast<uintptr_t>(ahead), 0, 32 * sizeof(T));
}

// absmax of n values (n a multiple of 32) and whether one was NaN/Inf: the integer maximum of the
// magnitude bits, as block_absmax does. 16-bit inputs compare their own 16-bit magnitudes (16 per
// vector); widening is monotone on magnitudes, so the widened maximum is the block's fp32 absmax.
// With ahead > 0 (quantize's first pass over a cold input) each group of 32 asks for the lines that far ahead.
inline float absmax(const float* x, int64_t n, bool* nonfinite, int64_t ahead = 0) {
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  for (int64_t i = 0; i < n; i += 32) {
    if (ahead) prefetch_group(x + i, ahead);
    const __m256i* p = reinterpret_cast<const __m256i*>(x + i);
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256(p), mask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256(p + 1), mask));
    m2 = _mm256_max_epu32(m2, _mm256_and_si256(_mm256_loadu_si256(p + 2), mask));
    m3 = _mm256_max_epu32(m3, _mm256_and_si256(_mm256_loadu_si256(p + 3), mask));
  }
  const uint32_t b = hmax_epu32(_mm256_max_epu32(_mm256_max_epu32(m0, m1), _mm256_max_epu32(m2, m3)));
  *nonfinite = b >= 0x7f800000u;
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}
inline uint32_t absmax_bits16(const void* x, int64_t n, int64_t ahead = 0) {
  const __m256i mask = _mm256_set1_epi16(0x7fff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  for (int64_t i = 0; i < n; i += 32) {
    if (ahead) prefetch_group(static_cast<const uint16_t*>(x) + i, ahead);
    const __m256i* p = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i);
    m0 = _mm256_max_epu16(m0, _mm256_and_si256(_mm256_loadu_si256(p), mask));
    m1 = _mm256_max_epu16(m1, _mm256_and_si256(_mm256_loadu_si256(p + 1), mask));
  }
  return hmax_epu16(_mm256_max_epu16(m0, m1));
}
// A 16-bit block's largest magnitude bits b as its fp32 absmax, and whether it was NaN/Inf (exponent all ones).
inline float absmax_of_bits16(const c10::BFloat16*, uint32_t b, bool* nonfinite) {
  *nonfinite = b >= 0x7f80u;
  const uint32_t w = b << 16;
  float r;
  std::memcpy(&r, &w, 4);
  return r;
}
inline float absmax_of_bits16(const c10::Half*, uint32_t b, bool* nonfinite) {
  *nonfinite = b >= 0x7c00u;
  return _cvtsh_ss(static_cast<unsigned short>(b));
}
template <typename T>
inline float absmax(const T* x, int64_t n, bool* nonfinite, int64_t ahead = 0) {  // bf16, fp16 (the fp32 overload above wins for float)
  return absmax_of_bits16(x, absmax_bits16(x, n, ahead), nonfinite);
}

// Nearest-rounded codes of 8 values: quantize_nearest_unchecked lane by lane.
struct NearestCodes {
  __m256 scale, hi, lo, magic, neg_magic;
  NearestCodes(float s, float fqmax)
      : scale(_mm256_set1_ps(s)), hi(_mm256_set1_ps(fqmax)), lo(_mm256_set1_ps(-fqmax)),
        magic(_mm256_set1_ps(12582912.0f)), neg_magic(_mm256_set1_ps(-12582912.0f)) {}
  __m256i operator()(__m256 x) const {
    __m256 v = _mm256_div_ps(x, scale);
    v = _mm256_min_ps(v, hi);  // v > qmax ? qmax : v (v == qmax gives qmax either way)
    v = _mm256_max_ps(v, lo);
    v = _mm256_add_ps(_mm256_add_ps(v, magic), neg_magic);  // round_nearest_even
    return _mm256_cvttps_epi32(v);                           // exact: v is an integer
  }
};

// The same codes without a division where that is provably exact. vdivps is the loop's costliest
// instruction: one per ~3 cycles here (about 1 ns, measured alone), against a multiply per half cycle.
//
// Let z = fl(x / s), the quotient the contract rounds, and y = fl(x * fl(1 / s)). With s a normal
// fp32 (s >= FLT_MIN, so 1 / s is finite and normal), each of the two roundings in y is relative
// 2^-24, so |y - x/s| <= |x/s| * (2^-23 + 2^-48); and |z - x/s| <= ulp(z) / 2. Since
// s = fl(absmax / qmax), |x/s| <= qmax * (1 + 2^-23), so for qmax <= 127: |y - z| < 1.6e-5 + 3.9e-6
// < 2^-15. (A result in the subnormal range has an absolute error below 2^-149.) The code is
// round-to-nearest-even of the clamped quotient, and clamping to the integers +-qmax commutes with
// rounding to an integer. So if y is more than 2^-14 from every half-integer (|y - rne(y)| <=
// kNearHalf = 0.5 - 2^-14), no half-integer lies between y and z: both round to the same integer,
// and the clamp keeps them equal. A group of 32 with a lane closer than that to a half-integer is
// redone with the division. On random data that is 0.4% of the 32-value groups for fp32 inputs,
// 1.2% for fp16 and 6-10% for bf16, whose coarse values often sit on ties. Where s is subnormal,
// the whole block uses the division.
//
// The clamp to +-qmax is not needed on this path: |x| <= absmax, so |x/s| <= qmax * (1 + 2^-23) and
// |y| < qmax + 2^-14 < qmax + 1/2, whose nearest integer is within +-qmax already.
//
// Per 8 values this is a multiply, the rounding convert, and four operations tracking the largest
// distance to the rounded integer (convert back, subtract, absolute value, running maximum); the
// group's one compare against kNearHalf comes after its 32 values (quantize_nearest).
struct ReciprocalCodes {
  static constexpr float kNearHalf = 0.5f - 1.0f / 16384.0f;  // |y - rne(y)| above this: too close
  __m256 inv, abs_mask, near_half;
  explicit ReciprocalCodes(float inverse_scale)  // inverse_scale = fl(1 / s)
      : inv(_mm256_set1_ps(inverse_scale)), abs_mask(_mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))),
        near_half(_mm256_set1_ps(kNearHalf)) {}
  // Codes of 8 values; *dist keeps the largest |y - rne(y)| seen (y is finite: the block is).
  __m256i operator()(__m256 x, __m256* dist) const {
    const __m256 y = _mm256_mul_ps(x, inv);
    const __m256i q = _mm256_cvtps_epi32(y);  // round to nearest even: MXCSR's default mode (see the top)
    *dist = _mm256_max_ps(*dist, _mm256_and_ps(_mm256_sub_ps(y, _mm256_cvtepi32_ps(q)), abs_mask));
    return q;
  }
  bool too_close(__m256 dist) const { return _mm256_movemask_ps(_mm256_cmp_ps(dist, near_half, _CMP_GT_OQ)) != 0; }
};

// 32 values as four fp32 vectors. fp32 and fp16 come in element order (0-7, 8-15, 16-23, 24-31).
// bf16 is widened with one in-lane unpack per vector (a bf16 is the top half of its fp32), which
// leaves the elements lane-interleaved: [0-3 | 8-11], [4-7 | 12-15], [16-19 | 24-27], [20-23 | 28-31].
// Codes do not depend on a value's lane; pack32_int8 puts them back in element order.
template <typename T>
constexpr bool kInterleaved = std::is_same_v<T, c10::BFloat16>;
template <typename T>
inline void load32(const T* x, __m256 v[4]) {
  for (int j = 0; j < 4; ++j) v[j] = load8(x + 8 * j);
}
inline void load32(const c10::BFloat16* x, __m256 v[4]) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a));
  v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a));
  v[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, b));
  v[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, b));
}

// 32 int32 codes, as load32 laid them out -> 32 int8 in element order.
template <bool kFromInterleaved>
inline __m256i pack32_int8(__m256i a, __m256i b, __m256i c, __m256i d) {
  // packs work per 128-bit lane. In element order (x0 = the low four values of x, x1 the high
  // four) the bytes come out as dwords a0 b0 c0 d0 | a1 b1 c1 d1: one dword permute restores the
  // order. Interleaved, they come out as qwords 0-7, 16-23 | 8-15, 24-31: one qword permute.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  if constexpr (kFromInterleaved) return _mm256_permute4x64_epi64(bytes, _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 int8 codes in [-7, 7] -> 16 bytes of nibble pairs (pack_int4: element 2i low, 2i+1 high).
inline __m128i pack32_int4(__m256i bytes) {
  // Each byte's low nibble n, then per 16-bit word n[2i] * 1 + n[2i+1] * 16 (vpmaddubsw: unsigned bytes times
  // signed ones, summed in pairs; at most 15 + 240, so exact and unsaturated), then narrowed: the bits of
  // (e[2i] & 0xf) | (e[2i+1] & 0xf) << 4 for any input bytes, in four instructions instead of six.
  const __m256i nibbles = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0f));
  const __m256i w = _mm256_maddubs_epi16(nibbles, _mm256_set1_epi16(0x1001));  // bytes 1, 16 (little-endian)
  return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

// Codes of n values (n a multiple of 32) of a block with usable scale, nearest rounding.
// inverse_scale = fl(1 / scale).
template <typename T>
inline void quantize_nearest(const T* x, int64_t n, int bits, float scale, float inverse_scale, uint8_t* data) {
  const float fqmax = static_cast<float>(qmax_for_bits(bits));
  const NearestCodes exact(scale, fqmax);
  const ReciprocalCodes fast(inverse_scale);
  const bool use_reciprocal = scale >= 1.17549435e-38f;  // FLT_MIN: s normal (ReciprocalCodes)
  for (int64_t i = 0; i < n; i += 32) {
    __m256 v[4];
    load32(x + i, v);
    // One flagged lane redoes the 32 values. Redoing only its vector of 8 (four branches instead of
    // one) measured slower for bf16, whose groups are flagged most often: 2.6 against 3.6 G values/s,
    // one core, in cache.
    __m256i q = _mm256_setzero_si256();
    __m256 dist = _mm256_setzero_ps();
    if (use_reciprocal) {
      q = pack32_int8<kInterleaved<T>>(fast(v[0], &dist), fast(v[1], &dist), fast(v[2], &dist), fast(v[3], &dist));
    }
    if (!use_reciprocal || fast.too_close(dist)) {
      q = pack32_int8<kInterleaved<T>>(exact(v[0]), exact(v[1]), exact(v[2]), exact(v[3]));
    }
    if (bits == 8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(data + i), q);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i / 2), pack32_int4(q));
    }
  }
}

// The scales of g <= 8 blocks from their absmax (absmax_of[j] for a finite block, bit j of
// nonfinite_mask set for a block with a NaN/Inf) and their reciprocals, as one vector division each
// (block_scale lane by lane, NaN for a non-finite block). Per block, the scale and its reciprocal
// are two dependent scalar divisions the code loop waits for; for 8 blocks at once they cost two
// vector divisions, and the absmax of the next blocks no longer waits behind them (measured: +20%
// for INT4 at block 128, where a block is only four loop iterations).
inline void block_scales(const float* absmax_of, int nonfinite_mask, int bits, float* scale_of, float* inverse_of) {
  const int qmax = qmax_for_bits(bits);
  __m256 scales = _mm256_div_ps(_mm256_load_ps(absmax_of), _mm256_set1_ps(static_cast<float>(qmax)));
  if (nonfinite_mask) {
    alignas(32) int32_t lanes[8];
    for (int j = 0; j < 8; ++j) lanes[j] = (nonfinite_mask >> j) & 1 ? -1 : 0;
    scales = _mm256_blendv_ps(scales, _mm256_set1_ps(block_scale(0.0f, true, qmax)),
                              _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(lanes))));
  }
  _mm256_store_ps(scale_of, scales);
  // 1 / scale for usable scales only, as the scalar path: lanes of zero or NaN scale (and unused
  // lanes) divide 1 by 1, so no division by zero or NaN raises an FP flag (trapping, under
  // feenableexcept, would kill the process).
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 usable = _mm256_cmp_ps(scales, _mm256_setzero_ps(), _CMP_GT_OQ);
  _mm256_store_ps(inverse_of, _mm256_div_ps(one, _mm256_blendv_ps(one, scales, usable)));
}

// Quantize g <= 8 consecutive full blocks of `block` values (a multiple of 32) of one row: their
// scales to scales_out[0..g) (unaligned fp32), their codes to data. The blocks' absmax come first,
// then their scales (block_scales), then `prepare_fn(scale_of, inverse_of)` (per-block constants of the
// code loop, all g blocks' at once), then the codes, `codes_fn(j, x_j, block, bits, scale, inverse, data_j)`
// for block j. `absmax_fn` and `codes_fn` are a vector width's absmax and code loop (this header's, or
// quant_cpu_avx512.h's).
template <typename T, typename AbsmaxFn, typename PrepareFn, typename CodesFn>
inline void quantize_full_blocks_with(const T* x, int64_t g, int64_t block, int bits, uint8_t* scales_out,
                                      uint8_t* data, AbsmaxFn absmax_fn, PrepareFn prepare_fn, CodesFn codes_fn) {
  alignas(32) float absmax_of[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  alignas(32) float scale_of[8], inverse_of[8];
  int nonfinite_mask = 0;
  for (int64_t j = 0; j < g; ++j) {
    bool nonfinite = false;
    const float m = absmax_fn(x + j * block, block, &nonfinite);
    absmax_of[j] = nonfinite ? 0.0f : m;  // never divide an Inf/NaN (it may be signalling): NaN blended in below
    nonfinite_mask |= static_cast<int>(nonfinite) << j;
  }
  block_scales(absmax_of, nonfinite_mask, bits, scale_of, inverse_of);
  std::memcpy(scales_out, scale_of, 4 * g);
  prepare_fn(static_cast<const float*>(scale_of), static_cast<const float*>(inverse_of));
  const int64_t block_bytes = block * bits / 8;
  for (int64_t j = 0; j < g; ++j) {
    uint8_t* d = data + j * block_bytes;
    if (!scale_is_usable(scale_of[j])) {  // zero block (exact) or non-finite block (decodes NaN)
      std::memset(d, 0, block_bytes);
    } else {
      codes_fn(j, x + j * block, block, bits, scale_of[j], inverse_of[j], d);
    }
  }
}

// ---- INT4 codes of 16-bit values by comparison with the block's exact code boundaries ----
// quant_cpu_avx512.h's Int4Thresholds (its reasoning, its proof) at 8 lanes. Two differences: AVX2 has no
// embedded rounding, so s * mid_j is rounded to a float by the default mode (nearest) and stepped up one float
// where it came out below (it never is a float itself, so that is the float above it); and the table is shifted
// down one lane (lane j holds T_(j+1), lane 7 +inf), so the estimate e itself indexes it: no add per 8 values.
// mid_j for j = 0..7 (lane 0 a placeholder), the boundaries' exact multiples of s (quant_cpu_avx512.h): for even
// j, j - 1/2 - ulp(j - 1/2) / 2; for odd j, j - 1/2 plus half of the ulp above it. The AVX-512 table reads it as it
// is (lanes 1..7); this level reads the copy one lane down below.
alignas(64) constexpr double kInt4BoundaryMids[8] = {1.0,          0.5 + 0x1p-25, 1.5 - 0x1p-24, 2.5 + 0x1p-23,
                                                     3.5 - 0x1p-23, 4.5 + 0x1p-22, 5.5 - 0x1p-22, 6.5 + 0x1p-22};
// The same mids one lane down, for the 8-lane table: lane j holds mid_(j+1) (lane 7 a placeholder, +inf there).
alignas(32) constexpr double kInt4BoundaryMidsFrom1[8] = {kInt4BoundaryMids[1], kInt4BoundaryMids[2],
                                                          kInt4BoundaryMids[3], kInt4BoundaryMids[4],
                                                          kInt4BoundaryMids[5], kInt4BoundaryMids[6],
                                                          kInt4BoundaryMids[7], 1.0};
// The estimate's reciprocal, fl(fl(1 / s) * (1 - 2^-20)): below 1 / s by more than its roundings.
inline float int4_estimate_inverse(float inverse_scale) { return inverse_scale * (1.0f - 0x1p-20f); }

struct Int4Thresholds {
  __m256 table;    // lanes 0..6: T_1..T_7; lane 7: +inf (looked up for an estimate of 7)
  __m256 inv_low;  // fl(fl(1 / s) * (1 - 2^-20)), broadcast
  Int4Thresholds() = default;
  Int4Thresholds(float s, float inverse_scale) {
    const __m256d sd = _mm256_set1_pd(static_cast<double>(s));
    const __m256d d_lo = _mm256_mul_pd(sd, _mm256_load_pd(kInt4BoundaryMidsFrom1));  // exact
    const __m256d d_hi = _mm256_mul_pd(sd, _mm256_load_pd(kInt4BoundaryMidsFrom1 + 4));
    table = _mm256_blend_ps(_mm256_set_m128(up(d_hi), up(d_lo)),
                            _mm256_set1_ps(std::numeric_limits<float>::infinity()), 0x80);
    inv_low = _mm256_set1_ps(int4_estimate_inverse(inverse_scale));
  }
  // The least float above each of 4 doubles that are not floats themselves.
  static __m128 up(__m256d d) {
    const __m128 nearest = _mm256_cvtpd_ps(d);
    const __m256i below = _mm256_castpd_si256(_mm256_cmp_pd(_mm256_cvtps_pd(nearest), d, _CMP_LT_OQ));
    const __m128i below32 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(below, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
    return _mm_castsi128_ps(_mm_sub_epi32(_mm_castps_si128(nearest), below32));  // + 1 ulp where below (all > 0)
  }
  static bool applies(float s) { return s >= 0x1p-120f; }  // why: quant_cpu_avx512.h's
  // int32 codes of 8 values (|x| <= the block's absmax, finite): e = rne(|x| * inv_low) is the code of |x| or
  // one less (quant_cpu_avx512.h), so the code is e + [|x| >= T_(e+1)], T_(e+1) in lane e (0 <= e <= 7).
  __m256i operator()(__m256 x) const {
    const __m256 ax = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(ax, inv_low));  // nearest even: MXCSR's default mode
    const __m256 t = _mm256_permutevar8x32_ps(table, e);
    const __m256i code = _mm256_sub_epi32(e, _mm256_castps_si256(_mm256_cmp_ps(ax, t, _CMP_GE_OQ)));  // - (-1)
    return _mm256_sign_epi32(code, _mm256_castps_si256(x));  // negated for x < 0 (-0.0 too: its code is 0)
  }
};

// INT4 codes of n values (a multiple of 32) of a block, by its thresholds.
template <typename T>
inline void quantize_int4(const T* x, int64_t n, const Int4Thresholds& codes, uint8_t* data) {
  for (int64_t i = 0; i < n; i += 32) {
    __m256 v[4];
    load32(x + i, v);
    const __m256i q = pack32_int8<kInterleaved<T>>(codes(v[0]), codes(v[1]), codes(v[2]), codes(v[3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i / 2), pack32_int4(q));
  }
}

// g <= 8 full blocks at one vector width: INT4 blocks of 16-bit values by their thresholds (ThresholdsT,
// int4_fn), computed for all g blocks before their codes (their latency overlaps: one block's thresholds right
// before its codes measured 20% slower at block 128), the rest by the reciprocal (nearest_fn). fp32 values
// (inputs, Hadamard-rotated blocks, the fused ops' sums) are near a tie in 0.4% of groups, and there the
// reciprocal's loop is the cheaper one (INT4 quantize with Hadamard smoothing 6-10% faster, measured); the fp32
// instance has no threshold code at all (with it, its INT4 quantize measured 8% slower).
template <typename ThresholdsT, typename T, typename AbsmaxFn, typename NearestFn, typename Int4Fn>
inline void quantize_full_blocks_by(const T* x, int64_t g, int64_t block, int bits, uint8_t* scales_out,
                                    uint8_t* data, AbsmaxFn absmax_fn, NearestFn nearest_fn, Int4Fn int4_fn) {
  if constexpr (!std::is_same_v<T, float>) {
    if (bits == 4) {
      ThresholdsT thresholds[8];
      return quantize_full_blocks_with(
          x, g, block, 4, scales_out, data, absmax_fn,
          [&](const float* scale_of, const float* inverse_of) {
            for (int64_t j = 0; j < g; ++j)
              if (ThresholdsT::applies(scale_of[j])) thresholds[j] = ThresholdsT(scale_of[j], inverse_of[j]);
          },
          [&](int64_t j, const T* v, int64_t n, int b, float s, float inv, uint8_t* d) {
            if (ThresholdsT::applies(s)) return int4_fn(v, n, thresholds[j], d);
            nearest_fn(v, n, b, s, inv, d);  // a tiny scale: the division
          });
    }
  }
  quantize_full_blocks_with(x, g, block, bits, scales_out, data, absmax_fn, [](const float*, const float*) {},
                            [&](int64_t, const T* v, int64_t n, int b, float s, float inv, uint8_t* d) {
                              nearest_fn(v, n, b, s, inv, d);
                            });
}

template <typename T>
inline void quantize_full_blocks(const T* x, int64_t g, int64_t block, int bits, uint8_t* scales_out, uint8_t* data,
                                 int64_t ahead = 0) {
  quantize_full_blocks_by<Int4Thresholds>(
      x, g, block, bits, scales_out, data, [ahead](const T* v, int64_t n, bool* nf) { return absmax(v, n, nf, ahead); },
      [](const T* v, int64_t n, int b, float s, float inv, uint8_t* d) { quantize_nearest(v, n, b, s, inv, d); },
      [](const T* v, int64_t n, const Int4Thresholds& t, uint8_t* d) { quantize_int4(v, n, t, d); });
}

// 8 codes as fp32, starting at element i of the block's data (INT4: i a multiple of 8).
inline __m256 codes8(const uint8_t* data, int64_t i, int bits) {
  if (bits == 8)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + i))));
  // Elements i..i+7 are the nibbles of one little-endian 32-bit word, element i+j at bits 4j..4j+3:
  // shift each to the top of its lane, then back arithmetically (sign-extends as unpack_int4_lo/hi).
  uint32_t w;
  std::memcpy(&w, data + i / 2, 4);
  const __m256i to_top = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(static_cast<int>(w)), to_top), 28));
}

// 32 INT4 codes as fp32, elements i..i+31 of a row's data (i even; reads the 16 bytes at i / 2, so i + 32 must
// not pass the row's length), in element order in v[0..3]: the bytes' low and high nibbles sign-extended by one
// byte-table lookup each (16 values per instruction), interleaved back into element order, widened. Same
// values as codes8 (unpack_int4_lo/hi) in about 16 instructions per 32 values instead of 20.
inline void int4_codes32(const uint8_t* data, int64_t i, __m256 v[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + i / 2));
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i signed_of = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m128i lo = _mm_shuffle_epi8(signed_of, _mm_and_si128(bytes, nibble));                     // even elements
  const __m128i hi = _mm_shuffle_epi8(signed_of, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));  // odd elements
  const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(first, first)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(second, second)));
}

// Asks for the data of elements [e, stop) of every row kPrefetchBytes ahead of where the sums read it.
// Why: on this project's VM (AMD Zen 5) the hardware prefetchers lose track of three or more row streams when
// the rows are shorter than 8M values, whatever their alignment: the fused dequant-reduce-quantize of 4 INT8
// rows ran at 6-8 GB/s on one thread with rows of 1M-6M values and at 15-17 GB/s with rows of 8M-16M (rows
// cold in cache). With these prefetches every row length runs at 15-17 GB/s. Where the hardware keeps up (rows
// of 16M, cold) they cost 10-18%; rows of a few million values are the common case (a 40M-element gradient
// bucket over 8 ranks of a node gives rows of 5M). 512 bytes measured best of 512 to 4096, and the T1 and NTA
// hints no better. (A hint only: it never faults, past the end of a row either.)
constexpr int64_t kPrefetchBytes = 512;
inline void prefetch_ahead(const uint8_t* const* rows, int64_t chunks, int64_t nb, int bits, int64_t e, int64_t stop) {
  for (int64_t c = 0; c < chunks; ++c)
    prefetch_bytes(reinterpret_cast<uintptr_t>(rows[c]) + static_cast<uintptr_t>(4 * nb + kPrefetchBytes),
                   e * bits / 8, stop * bits / 8);
}

// reduce_rows' sums of elements [e, stop) of input block k (e even, stop - e a multiple of 8) to out[0..), 32
// values per step, the running sums in registers, with the prefetches. Not inlined: the INT4 loop inside
// reduce_rows changed the code of the INT8 loop there (measured 5-10% slower, alternating runs).
template <int kBits>
[[gnu::noinline]] void reduce_block(const uint8_t* const* rows, int64_t chunks, int64_t nb, int64_t k, int64_t e,
                                    int64_t stop, float* out) {
  prefetch_ahead(rows, chunks, nb, kBits, e, stop);
  int64_t i = e;
  for (; i + 32 <= stop; i += 32) {
    __m256 sum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < chunks; ++c) {
      float s;
      std::memcpy(&s, rows[c] + 4 * k, 4);
      const __m256 sv = _mm256_set1_ps(s);
      __m256 q[4];
      if constexpr (kBits == 4) {
        int4_codes32(rows[c] + 4 * nb, i, q);
      } else {
        for (int j = 0; j < 4; ++j) q[j] = codes8(rows[c] + 4 * nb, i + 8 * j, 8);
      }
      for (int j = 0; j < 4; ++j) sum[j] = _mm256_add_ps(sum[j], _mm256_mul_ps(q[j], sv));
    }
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + (i - e) + 8 * j, sum[j]);
  }
  for (; i < stop; i += 8) {
    __m256 sum = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      float s;
      std::memcpy(&s, rows[c] + 4 * k, 4);
      sum = _mm256_add_ps(sum, _mm256_mul_ps(codes8(rows[c] + 4 * nb, i, kBits), _mm256_set1_ps(s)));
    }
    _mm256_storeu_ps(out + (i - e), sum);
  }
}

// acc[0..n) = the sum over C packed rows of their decoded elements [e0, e0 + n), in row order from
// 0.0f as the reference sums (acc = 0; acc = acc + q_c * s_c): the running sum stays in a register
// instead of making C passes over acc. rows[c] is row c's start; e0, n and block multiples of 8, so
// each 8 values share one scale per row.
inline void reduce_rows(const uint8_t* const* rows, int64_t chunks, int64_t length, int bits, int64_t block,
                        int64_t e0, int64_t n, float* acc) {
  if (chunks == 0) return std::fill(acc, acc + n, 0.0f);
  const int64_t nb = num_blocks(length, block);
  for (int64_t e = e0; e < e0 + n;) {
    const int64_t k = e / block;
    const int64_t stop = std::min(e0 + n, (k + 1) * block);
    // INT8 too sums in registers with the prefetches. It used to sum row by row through acc (L1), which the
    // hardware prefetchers follow: on the Zen 5 VM that was 11% faster at this level (25.5 against 22.8 GB/s,
    // 4 rows of 16M values, 2 threads), but that CPU runs the AVX-512 level. On the AVX2-only Zen 3 VM, where
    // this level is the one that runs, the register sums were faster: deq_red_quant INT8 at 2 threads, 6.62 ->
    // 10.58 GB/s at 16M values and 8.88 -> 11.42 at 4M, medians of 7 alternating rounds
    // (docs/bench/2026-11-28-int8-fused-zen3).
    if (bits == 8) {
      reduce_block<8>(rows, chunks, nb, k, e, stop, acc + (e - e0));
    } else {
      reduce_block<4>(rows, chunks, nb, k, e, stop, acc + (e - e0));
    }
    e = stop;
  }
}

// y[0..n) = decoded elements [e0, e0 + n) of a block (n a multiple of 8): f32_mul(q, s).
inline void decode(const uint8_t* data, int64_t e0, int64_t n, int bits, float s, float* y) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  if (bits == 4) {
    for (; i + 32 <= n; i += 32) {
      __m256 q[4];
      int4_codes32(data, e0 + i, q);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + i + 8 * j, _mm256_mul_ps(q[j], sv));
    }
  }
  for (; i < n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(codes8(data, e0 + i, bits), sv));
}

// hadamard_run for h = 2^log2h >= 8: strides 1, 2, 4 inside each vector of 8, then the strides >= 8
// between vectors, then the scale. Each output lane is the scalar butterfly's a + b or a - b (the
// IEEE a + (-b)) of the same two values, stage after stage in the same order.
// The lower lane of a pair gets partner + x * 1 = b + a, the upper one partner + x * -1 = a + (-b), which
// IEEE defines a - b to be (multiplying by -1 is exact): one multiply and one add per stage instead of an
// add, a subtract and a blend, and half of the work on the multiply pipes.
template <int kImm>
inline __m256 butterfly_in_lane(__m256 x, __m256 signs) {
  return _mm256_add_ps(_mm256_permute_ps(x, kImm), _mm256_mul_ps(x, signs));
}
// Strides 1, 2 and 4 of 8 values in one register.
inline __m256 butterflies_in_lanes(__m256 x) {
  x = butterfly_in_lane<_MM_SHUFFLE(2, 3, 0, 1)>(x, _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1));  // stride 1
  x = butterfly_in_lane<_MM_SHUFFLE(1, 0, 3, 2)>(x, _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1));  // stride 2
  const __m256 partner = _mm256_permute2f128_ps(x, x, 0x01);  // stride 4: the other 128-bit half
  return _mm256_add_ps(partner, _mm256_mul_ps(x, _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1)));
}
// Strides first_stride, 2 * first_stride, ..., h / 2 of one run of h values in memory, then the scale.
inline void butterflies_between_vectors_and_scale(float* w, int log2h, int first_stride) {
  const int h = 1 << log2h;
  for (int d = first_stride; d < h; d <<= 1) {
    for (int i = 0; i < h; i += 2 * d) {
      for (int j = i; j < i + d; j += 8) {
        const __m256 a = _mm256_loadu_ps(w + j), b = _mm256_loadu_ps(w + j + d);
        _mm256_storeu_ps(w + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(w + j + d, _mm256_sub_ps(a, b));
      }
    }
  }
  const __m256 s = _mm256_set1_ps(hadamard_scale(log2h));
  for (int i = 0; i < h; i += 8) _mm256_storeu_ps(w + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), s));
}
inline void hadamard_run(float* v, int log2h) {
  const int h = 1 << log2h;
  for (int i = 0; i < h; i += 8) _mm256_storeu_ps(v + i, butterflies_in_lanes(_mm256_loadu_ps(v + i)));
  butterflies_between_vectors_and_scale(v, log2h, 8);
}

// out[0..n) = hadamard_range(x[0..n)) for n a multiple of 32 and of h = 2^log2h >= 8 (no partial
// run), x widened to fp32; out may be x (fp32, in place). Each group of 32 values makes all of its
// butterflies up to stride 16 in four registers (strides 1, 2, 4 in lane as in hadamard_run, 8 and
// 16 between the registers), so a run of up to 32 values never goes through memory between stages;
// longer runs finish their strides >= 32 in out. Same operations per lane, same stage order.
// `ahead` as absmax's (quantize's first pass over a cold input, when it rotates).
template <typename T>
inline void rotate(const T* x, int64_t n, int log2h, float* out, int64_t ahead = 0) {
  const int h = 1 << log2h;
  const __m256 scale = _mm256_set1_ps(hadamard_scale(log2h));
  for (int64_t i = 0; i < n; i += 32) {
    if (ahead) prefetch_group(x + i, ahead);
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = butterflies_in_lanes(load8(x + i + 8 * j));
    if (log2h >= 4) {  // stride 8
      for (int j = 0; j < 4; j += 2) {
        const __m256 a = v[j], b = v[j + 1];
        v[j] = _mm256_add_ps(a, b);
        v[j + 1] = _mm256_sub_ps(a, b);
      }
    }
    if (log2h >= 5) {  // stride 16
      for (int j = 0; j < 2; ++j) {
        const __m256 a = v[j], b = v[j + 2];
        v[j] = _mm256_add_ps(a, b);
        v[j + 2] = _mm256_sub_ps(a, b);
      }
    }
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + i + 8 * j, h <= 32 ? _mm256_mul_ps(v[j], scale) : v[j]);
  }
  if (h <= 32) return;
  for (int64_t r = 0; r < n; r += h) butterflies_between_vectors_and_scale(out + r, log2h, 32);
}

// Whether rotate applies to n values (else the per-run loops).
inline bool rotate_applies(int64_t n, int log2h) {
  return log2h >= 3 && n % 32 == 0 && n % (int64_t(1) << log2h) == 0;
}

}  // namespace avx2
