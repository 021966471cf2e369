// AVX-512 loops (16 fp32 lanes) for the hottest paths of the blocked quantize kernels: the Hadamard
// rotation, the nearest-rounding quantization of whole blocks and the fused ops' sums over chunks.
// Everything else at the x86-64-v4 level runs the AVX2 loops of quant_cpu_avx2.h, compiled for that level.
//
// NO include guard: quant_cpu_isa.h includes this inside the x86-64-v4 level's namespace only, after
// quant_cpu_avx2.h (whose helpers it reuses: block_scales, pack32_int4, the Hadamard strides >= 32).
//
// Why: at 8 lanes the rotation costs about as much as the quantization after it (a run of 32 values is
// four registers and each in-register stride a permute, a multiply and an add), and bf16 quantize with
// Hadamard smoothing measured 0.42x memcpy at INT8 and 0.24-0.34x at INT4 (docs/bench/2026-11-27-codecs,
// "before"). At 16 lanes a run of 32 is two registers and each stride the same three instructions.
//
// Same bits as the AVX2 and scalar loops, by the same argument as quant_cpu_avx2.h's header: lane i of
// every vector computes the scalar expression for element i with the same IEEE fp32 operations in the
// same order (each butterfly's a + b and a - b of the same two values, stage after stage in the order of
// hadamard_range; the codes by ReciprocalCodes' proof, or by the division where that proof does not
// apply, or, for INT4 codes of 16-bit values, by comparison with the block's exact code boundaries:
// Int4Thresholds and its proof). No FMA. tests/test_kernels.py checks this level against the reference
// wherever the CPU has it.

namespace avx512 {

// ---- 16 input values widened to fp32, in element order ----
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// One butterfly stage of stride kD (1, 2, 4 or 8) inside 16 lanes. Lane i pairs with lane i ^ kD: the
// lower lane of a pair gets a + b (partner + x * 1 = b + a), the upper one a - b (partner + x * -1 =
// a + (-b), which IEEE defines a - b to be; multiplying by -1 is exact), as hadamard_range's
// v[j] = a + b, v[j + d] = a - b. The multiply by +-1 instead of an add and a masked subtract moves half
// of the stage onto the multiply pipes: the rotation was bound by the add pipes.
template <int kD>
inline __m512 butterfly(__m512 x) {
  __m512 partner;
  if constexpr (kD == 1) {
    partner = _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1));
  } else if constexpr (kD == 2) {
    partner = _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2));
  } else if constexpr (kD == 4) {
    partner = _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1));  // 128-bit quarters swapped in pairs
  } else {
    partner = _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2));  // 256-bit halves swapped
  }
  constexpr __mmask16 upper = kD == 1 ? 0xAAAA : kD == 2 ? 0xCCCC : kD == 4 ? 0xF0F0 : 0xFF00;
  const __m512 signs = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), upper, _mm512_set1_ps(-1.0f));
  return _mm512_add_ps(partner, _mm512_mul_ps(x, signs));
}

// Strides 1 .. min(h, 16) / 2 of 16 values in one register (h = 2^log2h >= 8).
inline __m512 butterflies_in_register(__m512 x, int log2h) {
  x = butterfly<4>(butterfly<2>(butterfly<1>(x)));
  return log2h >= 4 ? butterfly<8>(x) : x;
}

// out[0..n) = hadamard_range(x[0..n)) for n a multiple of 32 and of h = 2^log2h >= 8 (avx2::rotate_applies):
// strides up to 16 in two registers per 32 values, longer runs finish their strides >= 32 in out.
template <typename T>
inline void rotate(const T* x, int64_t n, int log2h, float* out, int64_t /*ahead: no prefetch here (unmeasured at this level)*/ = 0) {
  const int h = 1 << log2h;
  const __m512 scale = _mm512_set1_ps(hadamard_scale(log2h));
  for (int64_t i = 0; i < n; i += 32) {
    __m512 a = butterflies_in_register(load16(x + i), log2h);
    __m512 b = butterflies_in_register(load16(x + i + 16), log2h);
    if (log2h >= 5) {  // stride 16
      const __m512 s = _mm512_add_ps(a, b);
      b = _mm512_sub_ps(a, b);
      a = s;
    }
    if (h <= 32) {
      a = _mm512_mul_ps(a, scale);
      b = _mm512_mul_ps(b, scale);
    }
    _mm512_storeu_ps(out + i, a);
    _mm512_storeu_ps(out + i + 16, b);
  }
  if (h <= 32) return;
  for (int64_t r = 0; r < n; r += h) avx2::butterflies_between_vectors_and_scale(out + r, log2h, 32);
}

// ---- absmax of n values (n a multiple of 32) and whether one was NaN/Inf (avx2::absmax's contract) ----
inline float absmax(const float* x, int64_t n, bool* nonfinite) {
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  __m512i m0 = _mm512_setzero_si512(), m1 = m0;
  for (int64_t i = 0; i < n; i += 32) {
    m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), mask));
    m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 16), mask));
  }
  const uint32_t b = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
  *nonfinite = b >= 0x7f800000u;
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}
inline uint32_t absmax_bits16(const void* x, int64_t n) {
  const __m512i mask = _mm512_set1_epi16(0x7fff);
  __m512i m = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 32)
    m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(static_cast<const uint16_t*>(x) + i), mask));
  // 32 words -> the largest: the high half of each dword against its low half, then across dwords.
  m = _mm512_max_epu16(m, _mm512_srli_epi32(m, 16));
  return _mm512_reduce_max_epu32(_mm512_and_si512(m, _mm512_set1_epi32(0xffff)));
}
template <typename T>
inline float absmax(const T* x, int64_t n, bool* nonfinite) {  // bf16, fp16 (the fp32 overload above wins for float)
  return avx2::absmax_of_bits16(x, absmax_bits16(x, n), nonfinite);
}

// Codes of 16 values by the division: avx2::NearestCodes at 16 lanes.
struct NearestCodes {
  __m512 scale, hi, lo, magic, neg_magic;
  NearestCodes(float s, float fqmax)
      : scale(_mm512_set1_ps(s)), hi(_mm512_set1_ps(fqmax)), lo(_mm512_set1_ps(-fqmax)),
        magic(_mm512_set1_ps(12582912.0f)), neg_magic(_mm512_set1_ps(-12582912.0f)) {}
  __m512i operator()(__m512 x) const {
    __m512 v = _mm512_div_ps(x, scale);
    v = _mm512_min_ps(v, hi);
    v = _mm512_max_ps(v, lo);
    v = _mm512_add_ps(_mm512_add_ps(v, magic), neg_magic);  // round_nearest_even
    return _mm512_cvttps_epi32(v);                           // exact: v is an integer
  }
};

// Codes of 16 values by the reciprocal: avx2::ReciprocalCodes (its proof, its tie distance) at 16 lanes.
struct ReciprocalCodes {
  __m512 inv;
  explicit ReciprocalCodes(float inverse_scale) : inv(_mm512_set1_ps(inverse_scale)) {}
  __m512i operator()(__m512 x, __m512* dist) const {
    const __m512 y = _mm512_mul_ps(x, inv);
    const __m512i q = _mm512_cvtps_epi32(y);  // round to nearest even: MXCSR's default mode
    *dist = _mm512_max_ps(*dist, _mm512_abs_ps(_mm512_sub_ps(y, _mm512_cvtepi32_ps(q))));
    return q;
  }
  static bool too_close(__m512 dist) {
    return _mm512_cmp_ps_mask(dist, _mm512_set1_ps(avx2::ReciprocalCodes::kNearHalf), _CMP_GT_OQ) != 0;
  }
};

// 32 int32 codes (elements 0-15 in a, 16-31 in b; within +-127) -> 32 int8 in element order. The packs
// work per 128-bit quarter q: the bytes come out as dwords a[4q..4q+3], b[4q..4q+3] (twice), and one
// dword permute puts them in order (cheaper here than two vpmovsdb).
inline __m256i pack32_int8(__m512i a, __m512i b) {
  const __m512i words = _mm512_packs_epi32(a, b);
  const __m512i bytes = _mm512_packs_epi16(words, words);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, bytes));
}

// ---- INT4 codes by comparison with the block's exact code boundaries ----
// Why: with the reciprocal (ReciprocalCodes) a 32-value group that has a lane near a tie is redone by the
// division behind a branch the CPU cannot predict, and 16-bit inputs sit on INT4 ties by themselves (a value
// of exactly absmax / 2 gives x / scale ~= 3.5): 7% of random bf16 groups, which cost a quarter of INT4 bf16
// quantize's time here. INT4 has only seven code boundaries, so each block gets them exactly, once, and each
// value's code is an estimate plus one compare with a boundary, no branch.
//
// The code of x is c(x) = rne(clamp(fl(x / s), +-7)) (quantize_nearest_unchecked): odd in x and, for x >= 0,
// non-decreasing. T_j (j = 1..7) is the least float a >= 0 with c(a) >= j. Let m_j be the least float that
// rne takes to j or more (j - 1/2 for even j, whose tie rne sends up; the float after j - 1/2 for odd j) and
// mid_j the midpoint between m_j and the float before it. fl(a / s) >= m_j exactly when a / s > mid_j (at
// a / s == mid_j, fl() picks the even significand of the two). mid_j's significand is 25 bits with the last
// one set, so s * mid_j (exact in double: 24 + 25 bits) never is a float itself: a / s == mid_j never happens,
// and T_j is s * mid_j rounded up to a float (the instruction's own rounding mode; MXCSR plays no part).
// With s >= 2^-120 every T_j is a normal float (no denormal compares).
struct Int4Thresholds {
  __m512 table;    // lanes 1..7: T_1..T_7; lane 8: +inf (lanes 0 and 9..15 are never looked up)
  __m512 inv_low;  // fl(fl(1 / s) * (1 - 2^-20)), broadcast
  Int4Thresholds() = default;
  Int4Thresholds(float s, float inverse_scale) {
    // mid_j (avx2::kInt4BoundaryMids; for odd j, m_j's predecessor is j - 1/2 itself) times s: exact
    const __m512d d = _mm512_mul_pd(_mm512_set1_pd(static_cast<double>(s)), _mm512_load_pd(avx2::kInt4BoundaryMids));
    const __m256 up = _mm512_cvt_roundpd_ps(d, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    table = _mm512_mask_mov_ps(_mm512_set1_ps(std::numeric_limits<float>::infinity()), 0x00FF,
                               _mm512_castps256_ps512(up));
    inv_low = _mm512_set1_ps(avx2::int4_estimate_inverse(inverse_scale));
  }
  // s >= 2^-120: s is normal (the relative error bounds above hold and 1 / s is finite; with a subnormal s the
  // estimate could reach 8) and every T_j is a normal float (no denormal compares). Smaller scales divide.
  static bool applies(float s) { return s >= 0x1p-120f; }
  // int32 codes of 16 values (|x| <= the block's absmax, finite). e = rne(|x| * inv_low) is the code of |x|
  // or one less: |x| * inv_low lies below fl(|x| / s) (inv_low shrinks by 2^-20, more than the four roundings'
  // 4 * 2^-24: fl(1 / s), the shrink, the product, and fl(|x| / s) itself) and below 7, both rounding and the
  // clamp are monotone, and it is within 1e-4 of min(fl(|x| / s), 7). So the code of |x| is
  // e + [|x| >= T_(e+1)], one table lookup.
  __m512i operator()(__m512 x) const {
    const __m512 ax = _mm512_abs_ps(x);
    const __m512i e = _mm512_cvt_roundps_epi32(_mm512_mul_ps(ax, inv_low), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i next = _mm512_add_epi32(e, _mm512_set1_epi32(1));
    const __m512i code = _mm512_mask_mov_epi32(e, _mm512_cmp_ps_mask(ax, _mm512_permutexvar_ps(next, table), _CMP_GE_OQ), next);
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_sub_epi32(code, negative, _mm512_setzero_si512(), code);
  }
};

// Codes of n values (n a multiple of 32) of a block with usable scale, nearest rounding: 32 values at a
// time, redone by the division when a lane is too close to a tie (as avx2::quantize_nearest).
template <typename T>
inline void quantize_nearest(const T* x, int64_t n, int bits, float scale, float inverse_scale, uint8_t* data) {
  const NearestCodes exact(scale, static_cast<float>(qmax_for_bits(bits)));
  const ReciprocalCodes fast(inverse_scale);
  const bool use_reciprocal = scale >= 1.17549435e-38f;  // FLT_MIN: s normal (ReciprocalCodes' proof)
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 a = load16(x + i), b = load16(x + i + 16);
    __m512i qa, qb;
    __m512 dist = _mm512_setzero_ps();
    if (use_reciprocal) {
      qa = fast(a, &dist);
      qb = fast(b, &dist);
    }
    if (!use_reciprocal || ReciprocalCodes::too_close(dist)) {
      qa = exact(a);
      qb = exact(b);
    }
    const __m256i codes = pack32_int8(qa, qb);
    if (bits == 8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(data + i), codes);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i / 2), avx2::pack32_int4(codes));
    }
  }
}

// INT4 codes of n values (a multiple of 32) of a block, by its thresholds.
template <typename T>
inline void quantize_int4(const T* x, int64_t n, const Int4Thresholds& codes, uint8_t* data) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m256i q = pack32_int8(codes(load16(x + i)), codes(load16(x + i + 16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i / 2), avx2::pack32_int4(q));
  }
}

// avx2::quantize_full_blocks at 16 lanes: g <= 8 full blocks of `block` values (a multiple of 32), INT4 blocks
// of 16-bit values by their thresholds (avx2::quantize_full_blocks_by says why not fp32).
template <typename T>
inline void quantize_full_blocks(const T* x, int64_t g, int64_t block, int bits, uint8_t* scales_out, uint8_t* data,
                                 int64_t /*ahead: as rotate's*/ = 0) {
  avx2::quantize_full_blocks_by<Int4Thresholds>(
      x, g, block, bits, scales_out, data, [](const T* v, int64_t n, bool* nf) { return absmax(v, n, nf); },
      [](const T* v, int64_t n, int b, float s, float inv, uint8_t* d) { quantize_nearest(v, n, b, s, inv, d); },
      [](const T* v, int64_t n, const Int4Thresholds& t, uint8_t* d) { quantize_int4(v, n, t, d); });
}

// 16 codes as fp32, starting at element i of a block's data (i a multiple of 16): avx2::codes8 at 16 lanes.
inline __m512 codes16(const uint8_t* data, int64_t i, int bits) {
  if (bits == 8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + i))));
  // Elements i..i+15 are the nibbles of one little-endian 64-bit word: lanes 0-7 take its low dword, lanes
  // 8-15 its high one, and each lane shifts its nibble to the top and back arithmetically (sign-extends).
  uint64_t w;
  std::memcpy(&w, data + i / 2, 8);
  const __m512i dwords = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                  _mm512_castsi128_si512(_mm_cvtsi64_si128(static_cast<long long>(w))));
  const __m512i to_top = _mm512_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_sllv_epi32(dwords, to_top), 28));
}

// INT4 rows, 32 values per step (e0, n and block multiples of 32): each byte's two nibbles index a table of the
// sixteen codes as fp32 (the table lookup is the decode: no shifts to the top and back, no int -> float convert),
// the even elements summed in one register and the odd ones in another, interleaved once per 32 sums instead
// of once per row. The same sum in the same row order as reduce_rows.
inline void reduce_rows_int4(const uint8_t* const* rows, int64_t chunks, int64_t nb, int64_t block, int64_t e0,
                             int64_t n, float* acc) {
  const __m512 code_of_nibble = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512i first_half = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t e = e0; e < e0 + n;) {
    const int64_t k = e / block;
    const int64_t stop = std::min(e0 + n, (k + 1) * block);
    avx2::prefetch_ahead(rows, chunks, nb, 4, e, stop);
    for (int64_t i = e; i < stop; i += 32) {
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        float s;
        std::memcpy(&s, rows[c] + 4 * k, 4);
        const __m512 sv = _mm512_set1_ps(s);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[c] + 4 * nb + i / 2)));
        even = _mm512_add_ps(even, _mm512_mul_ps(_mm512_permutexvar_ps(bytes, code_of_nibble), sv));  // low nibbles
        odd = _mm512_add_ps(odd, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), code_of_nibble), sv));
      }
      _mm512_storeu_ps(acc + (i - e0), _mm512_permutex2var_ps(even, first_half, odd));
      _mm512_storeu_ps(acc + (i - e0) + 16, _mm512_permutex2var_ps(even, second_half, odd));
    }
    e = stop;
  }
}

// avx2::reduce_rows at 16 lanes (the same sum, in the same chunk order, from 0.0f) where e0, n and block are
// multiples of 16 (INT4 at multiples of 32: reduce_rows_int4); the 8-lane loop elsewhere.
inline void reduce_rows(const uint8_t* const* rows, int64_t chunks, int64_t length, int bits, int64_t block,
                        int64_t e0, int64_t n, float* acc) {
  if (e0 % 16 || n % 16 || block % 16) return avx2::reduce_rows(rows, chunks, length, bits, block, e0, n, acc);
  const int64_t nb = num_blocks(length, block);
  if (bits == 4 && e0 % 32 == 0 && n % 32 == 0 && block % 32 == 0)
    return reduce_rows_int4(rows, chunks, nb, block, e0, n, acc);
  for (int64_t e = e0; e < e0 + n;) {
    const int64_t k = e / block;
    const int64_t stop = std::min(e0 + n, (k + 1) * block);
    avx2::prefetch_ahead(rows, chunks, nb, bits, e, stop);
    for (int64_t i = e; i < stop; i += 16) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        float s;
        std::memcpy(&s, rows[c] + 4 * k, 4);
        sum = _mm512_add_ps(sum, _mm512_mul_ps(codes16(rows[c] + 4 * nb, i, bits), _mm512_set1_ps(s)));
      }
      _mm512_storeu_ps(acc + (i - e0), sum);
    }
    e = stop;
  }
}

}  // namespace avx512
