// The ZFP CPU loops, compiled once per instruction-set level (like quant_cpu_isa.h, whose comment
// explains the scheme). NO include guard: zfp_cpu.cpp includes this file once per level, with
// ZPP_ZFP_ISA_NS naming its namespace and ZPP_ZFP_ISA_LEVEL = 0 (baseline), 3 (x86-64-v3: AVX2,
// F16C) or 4 (x86-64-v4: AVX-512). The block math comes from zpp/zfp_math.h, whose functions are
// always inlined, so each level's copy gets that level's instructions.
//
// The baseline level runs zfp_math.h's plain path, the one the CUDA kernels run. The higher levels
// replace steps of it (BlockOps): bit planes by movemask / test-mask instructions, 1-D planes by table
// steps, and at x86-64-v4 the whole 2-D / 3-D block transform in registers. Every level writes the
// same bits (tests/test_zfp.py runs each against zfpy).
//
// Defines zpp::ZPP_ZFP_ISA_NS::{encode, decode} (see ZfpKernels in zfp_cpu.cpp).

namespace zpp {
namespace ZPP_ZFP_ISA_NS {
namespace {

using namespace zpp::zfp;

inline float load_f32(const float* p, int64_t i) { return p[i]; }
inline float load_f32(const c10::BFloat16* p, int64_t i) { return f32_from_bits(static_cast<uint32_t>(p[i].x) << 16); }
inline float load_f32(const c10::Half* p, int64_t i) {
#if ZPP_ZFP_ISA_LEVEL >= 3
  return _cvtsh_ss(p[i].x);
#else
  return static_cast<float>(p[i]);
#endif
}

inline void store_f32(float* p, int64_t i, float v) { p[i] = v; }
inline void store_f32(c10::BFloat16* p, int64_t i, float v) { p[i] = c10::BFloat16(v); }  // nearest-even, NaN kept
inline void store_f32(c10::Half* p, int64_t i, float v) {
#if ZPP_ZFP_ISA_LEVEL >= 3
  p[i] = c10::Half(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT), c10::Half::from_bits());
#else
  p[i] = c10::Half(v);
#endif
}

// The block steps with the level's instructions (zfp::BlockOpsScalar lists them): bit planes with
// movemask / test-mask instead of a loop per coefficient, and at x86-64-v4 the coefficient reorder as
// in-register permutes (scalar stores followed by vector loads would stall on store forwarding).
#if ZPP_ZFP_ISA_LEVEL == 0
// The baseline level runs the plain path, the one the CUDA kernels run (zfp_math.h), so the tests
// of every level check the GPU's code path on the CPU too.
using BlockOps = BlockOpsScalar;
#else
struct BlockOps {
  static constexpr bool kTableSteps4 = true;
#if ZPP_ZFP_ISA_LEVEL == 4
  // A 4x4x4 block in four registers: r[z] lane x + 4y. Lifts are lane-parallel along z directly; for
  // x and y the registers are transposed (an involution) so the axis runs across registers, lifted,
  // and transposed back. Same integer operations as zfp::fwd_lift / inv_lift, lane by lane.
  static inline void fwd_lift(__m512i& x, __m512i& y, __m512i& z, __m512i& w) {
    x = _mm512_add_epi32(x, w); x = _mm512_srai_epi32(x, 1); w = _mm512_sub_epi32(w, x);
    z = _mm512_add_epi32(z, y); z = _mm512_srai_epi32(z, 1); y = _mm512_sub_epi32(y, z);
    x = _mm512_add_epi32(x, z); x = _mm512_srai_epi32(x, 1); z = _mm512_sub_epi32(z, x);
    w = _mm512_add_epi32(w, y); w = _mm512_srai_epi32(w, 1); y = _mm512_sub_epi32(y, w);
    w = _mm512_add_epi32(w, _mm512_srai_epi32(y, 1)); y = _mm512_sub_epi32(y, _mm512_srai_epi32(w, 1));
  }
  static inline void inv_lift(__m512i& x, __m512i& y, __m512i& z, __m512i& w) {
    y = _mm512_add_epi32(y, _mm512_srai_epi32(w, 1)); w = _mm512_sub_epi32(w, _mm512_srai_epi32(y, 1));
    y = _mm512_add_epi32(y, w); w = _mm512_slli_epi32(w, 1); w = _mm512_sub_epi32(w, y);
    z = _mm512_add_epi32(z, x); x = _mm512_slli_epi32(x, 1); x = _mm512_sub_epi32(x, z);
    y = _mm512_add_epi32(y, z); z = _mm512_slli_epi32(z, 1); z = _mm512_sub_epi32(z, y);
    w = _mm512_add_epi32(w, x); x = _mm512_slli_epi32(x, 1); x = _mm512_sub_epi32(x, w);
  }
  // 4x4 transpose of 32-bit elements inside every 128-bit lane: afterwards r[i] holds element i of
  // each row (x runs across registers).
  static inline void transpose_x(__m512i* r) {
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm512_unpacklo_epi64(t0, t2);
    r[1] = _mm512_unpackhi_epi64(t0, t2);
    r[2] = _mm512_unpacklo_epi64(t1, t3);
    r[3] = _mm512_unpackhi_epi64(t1, t3);
  }
  // 4x4 transpose of the 128-bit lanes (y runs across registers).
  static inline void transpose_y(__m512i* r) {
    const __m512i t0 = _mm512_shuffle_i32x4(r[0], r[1], 0x44), t1 = _mm512_shuffle_i32x4(r[0], r[1], 0xee);
    const __m512i t2 = _mm512_shuffle_i32x4(r[2], r[3], 0x44), t3 = _mm512_shuffle_i32x4(r[2], r[3], 0xee);
    r[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    r[1] = _mm512_shuffle_i32x4(t0, t2, 0xdd);
    r[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    r[3] = _mm512_shuffle_i32x4(t1, t3, 0xdd);
  }
  // The same lifts on 128-bit registers (2-D blocks: one register per row of 4).
  static inline void fwd_lift(__m128i& x, __m128i& y, __m128i& z, __m128i& w) {
    x = _mm_add_epi32(x, w); x = _mm_srai_epi32(x, 1); w = _mm_sub_epi32(w, x);
    z = _mm_add_epi32(z, y); z = _mm_srai_epi32(z, 1); y = _mm_sub_epi32(y, z);
    x = _mm_add_epi32(x, z); x = _mm_srai_epi32(x, 1); z = _mm_sub_epi32(z, x);
    w = _mm_add_epi32(w, y); w = _mm_srai_epi32(w, 1); y = _mm_sub_epi32(y, w);
    w = _mm_add_epi32(w, _mm_srai_epi32(y, 1)); y = _mm_sub_epi32(y, _mm_srai_epi32(w, 1));
  }
  static inline void inv_lift(__m128i& x, __m128i& y, __m128i& z, __m128i& w) {
    y = _mm_add_epi32(y, _mm_srai_epi32(w, 1)); w = _mm_sub_epi32(w, _mm_srai_epi32(y, 1));
    y = _mm_add_epi32(y, w); w = _mm_slli_epi32(w, 1); w = _mm_sub_epi32(w, y);
    z = _mm_add_epi32(z, x); x = _mm_slli_epi32(x, 1); x = _mm_sub_epi32(x, z);
    y = _mm_add_epi32(y, z); z = _mm_slli_epi32(z, 1); z = _mm_sub_epi32(z, y);
    w = _mm_add_epi32(w, x); x = _mm_slli_epi32(x, 1); x = _mm_sub_epi32(x, w);
  }
  static inline void transpose4(__m128i* r) {  // r[y][x] -> r[x][y]
    const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpackhi_epi32(r[0], r[1]);
    const __m128i t2 = _mm_unpacklo_epi32(r[2], r[3]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm_unpacklo_epi64(t0, t2);
    r[1] = _mm_unpackhi_epi64(t0, t2);
    r[2] = _mm_unpacklo_epi64(t1, t3);
    r[3] = _mm_unpackhi_epi64(t1, t3);
  }
  static inline __m512i table16(const uint8_t* idx) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(idx)));
  }

  // out[j] = in[idx[j]] over the 64 lanes of r (idx: a 64-entry uint8 table).
  static inline __m512i permute64(const __m512i* r, const uint8_t* idx, int j) {
    const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(idx + j)));
    const __m512i lo = _mm512_permutex2var_epi32(r[0], i, r[1]);  // entries 0..31 (index bit 4 picks r[1])
    const __m512i hi = _mm512_permutex2var_epi32(r[2], i, r[3]);  // entries 32..63
    return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(i, _mm512_set1_epi32(32)), lo, hi);
  }
#endif

  static inline void forward(const float* f, int e, int dims, int32_t* iblock, uint32_t* u) {
#if ZPP_ZFP_ISA_LEVEL == 4
    if (dims == 3) {
      __m512i r[4];
      if (e <= kOverflowBiasedExponent) {
        for (auto& v : r) v = _mm512_set1_epi32(INT32_MIN);  // as zfp::BlockOpsScalar::forward
      } else {
        const __m512 s = _mm512_set1_ps(cast_scale(e - kExpBias));
        for (int z = 0; z < 4; ++z) r[z] = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_loadu_ps(f + 16 * z), s));
      }
      transpose_x(r);
      fwd_lift(r[0], r[1], r[2], r[3]);
      transpose_x(r);
      transpose_y(r);
      fwd_lift(r[0], r[1], r[2], r[3]);
      transpose_y(r);
      fwd_lift(r[0], r[1], r[2], r[3]);
      const __m512i nb = _mm512_set1_epi32(static_cast<int>(kNegabinaryMask));
      for (int j = 0; j < 64; j += 16)
        _mm512_storeu_si512(u + j, _mm512_xor_si512(_mm512_add_epi32(permute64(r, kPerm3, j), nb), nb));
      return;
    }
    if (dims == 2) {
      __m128i r[4];  // r[y]: the row's 4 values
      if (e <= kOverflowBiasedExponent) {
        for (auto& v : r) v = _mm_set1_epi32(INT32_MIN);
      } else {
        const __m128 s = _mm_set1_ps(cast_scale(e - kExpBias));
        for (int y = 0; y < 4; ++y) r[y] = _mm_cvttps_epi32(_mm_mul_ps(_mm_loadu_ps(f + 4 * y), s));
      }
      transpose4(r);
      fwd_lift(r[0], r[1], r[2], r[3]);  // along x
      transpose4(r);
      fwd_lift(r[0], r[1], r[2], r[3]);  // along y
      __m512i v = _mm512_castsi128_si512(r[0]);
      v = _mm512_inserti32x4(v, r[1], 1);
      v = _mm512_inserti32x4(v, r[2], 2);
      v = _mm512_inserti32x4(v, r[3], 3);
      const __m512i nb = _mm512_set1_epi32(static_cast<int>(kNegabinaryMask));
      v = _mm512_permutexvar_epi32(table16(kPerm2), v);
      _mm512_storeu_si512(u, _mm512_xor_si512(_mm512_add_epi32(v, nb), nb));
      return;
    }
#endif
    BlockOpsScalar::forward(f, e, dims, iblock, u);
  }

  static inline void inverse(const uint32_t* u, int e, int dims, int32_t* iblock, float* f) {
#if ZPP_ZFP_ISA_LEVEL == 4
    if (dims == 3) {
      __m512i c[4], r[4];
      for (int j = 0; j < 4; ++j) c[j] = _mm512_loadu_si512(u + 16 * j);
      const __m512i nb = _mm512_set1_epi32(static_cast<int>(kNegabinaryMask));
      for (int j = 0; j < 4; ++j) r[j] = _mm512_sub_epi32(_mm512_xor_si512(permute64(c, kInvPerm3, 16 * j), nb), nb);
      inv_lift(r[0], r[1], r[2], r[3]);
      transpose_y(r);
      inv_lift(r[0], r[1], r[2], r[3]);
      transpose_y(r);
      transpose_x(r);
      inv_lift(r[0], r[1], r[2], r[3]);
      transpose_x(r);
      const __m512 s = _mm512_set1_ps(uncast_scale(e - kExpBias));
      for (int z = 0; z < 4; ++z) _mm512_storeu_ps(f + 16 * z, _mm512_mul_ps(_mm512_cvtepi32_ps(r[z]), s));
      return;
    }
    if (dims == 2) {
      const __m512i nb = _mm512_set1_epi32(static_cast<int>(kNegabinaryMask));
      const __m512i c = _mm512_loadu_si512(u);
      const __m512i v = _mm512_sub_epi32(_mm512_xor_si512(_mm512_permutexvar_epi32(table16(kInvPerm2), c), nb), nb);
      __m128i r[4] = {_mm512_castsi512_si128(v), _mm512_extracti32x4_epi32(v, 1), _mm512_extracti32x4_epi32(v, 2),
                      _mm512_extracti32x4_epi32(v, 3)};
      inv_lift(r[0], r[1], r[2], r[3]);  // along y
      transpose4(r);
      inv_lift(r[0], r[1], r[2], r[3]);  // along x
      transpose4(r);
      const __m128 s = _mm_set1_ps(uncast_scale(e - kExpBias));
      for (int y = 0; y < 4; ++y) _mm_storeu_ps(f + 4 * y, _mm_mul_ps(_mm_cvtepi32_ps(r[y]), s));
      return;
    }
#endif
    BlockOpsScalar::inverse(u, e, dims, iblock, f);
  }

  static inline uint64_t extract(const uint32_t* u, int size, int k) {
#if ZPP_ZFP_ISA_LEVEL == 4
    const __m512i bit = _mm512_set1_epi32(static_cast<int>(uint32_t(1) << k));
    if (size == 64) {
      const uint64_t m0 = _mm512_test_epi32_mask(_mm512_loadu_si512(u), bit);
      const uint64_t m1 = _mm512_test_epi32_mask(_mm512_loadu_si512(u + 16), bit);
      const uint64_t m2 = _mm512_test_epi32_mask(_mm512_loadu_si512(u + 32), bit);
      const uint64_t m3 = _mm512_test_epi32_mask(_mm512_loadu_si512(u + 48), bit);
      return m0 | (m1 << 16) | (m2 << 32) | (m3 << 48);
    }
    if (size == 16) return _mm512_test_epi32_mask(_mm512_loadu_si512(u), bit);
#elif ZPP_ZFP_ISA_LEVEL == 3
    if (size >= 16) {
      const __m128i shift = _mm_cvtsi32_si128(31 - k);  // bit k to the sign bit, then movemask
      uint64_t x = 0;
      for (int c = 0; c < size; c += 8) {
        const __m256i v = _mm256_sll_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + c)), shift);
        x |= static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(v)))) << c;
      }
      return x;
    }
#endif
    return BlockOpsScalar::extract(u, size, k);
  }

  static inline void deposit(uint32_t* u, int size, int k, uint64_t x) {
#if ZPP_ZFP_ISA_LEVEL == 4
    if (size >= 16) {  // OR bit k into the lanes the mask selects
      const __m512i bit = _mm512_set1_epi32(static_cast<int>(uint32_t(1) << k));
      for (int c = 0; c < size; c += 16) {
        const __m512i v = _mm512_loadu_si512(u + c);
        _mm512_storeu_si512(u + c, _mm512_mask_or_epi32(v, static_cast<__mmask16>(x >> c), v, bit));
      }
      return;
    }
#elif ZPP_ZFP_ISA_LEVEL == 3
    if (size >= 16) {  // byte of the mask -> 8 lanes: broadcast, select lane bit, compare
      const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      const __m256i bit = _mm256_set1_epi32(static_cast<int>(uint32_t(1) << k));
      for (int c = 0; c < size; c += 8) {
        const __m256i b = _mm256_set1_epi32(static_cast<int>((x >> c) & 0xff));
        const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bits), lane_bits);
        __m256i* p = reinterpret_cast<__m256i*>(u + c);
        _mm256_storeu_si256(p, _mm256_or_si256(_mm256_loadu_si256(p), _mm256_and_si256(on, bit)));
      }
      return;
    }
#endif
    BlockOpsScalar::deposit(u, size, k, x);
  }
};
#endif  // ZPP_ZFP_ISA_LEVEL

// Each parallel task gets at least this many values: amortizes the task start, still balances.
constexpr int64_t kGrainValues = 1 << 15;

// Encode numel values of x into payload (payload_bytes(numel, dims, maxbits) bytes). Parallel over
// chunks of blocks that fill whole words (chunk_blocks), so no two tasks write the same word.
template <int dims, typename T>
void encode_impl(const T* x, int64_t numel, int maxbits, uint8_t* payload) {
  const int bv = block_values(dims);
  const int64_t nb = num_blocks(numel, dims);
  const int64_t per_chunk = chunk_blocks(maxbits);
  const int64_t chunks = (nb + per_chunk - 1) / per_chunk;
  const int64_t grain = std::max<int64_t>(1, kGrainValues / (per_chunk * bv));
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    alignas(64) float f[64];
    alignas(64) int32_t iblock[64];
    alignas(64) uint32_t u[64];
    WordWriter w(payload + c0 * per_chunk * maxbits / 8);
    const int64_t b1 = std::min(c1 * per_chunk, nb);
    for (int64_t b = c0 * per_chunk; b < b1; ++b) {
      const int64_t e0 = b * bv;
      const int v = static_cast<int>(std::min<int64_t>(bv, numel - e0));
      const float* block = f;
      if constexpr (std::is_same_v<T, float>) {
        if (v == bv) block = x + e0;  // whole fp32 block: read in place
      }
      if (block == f) {
        for (int i = 0; i < v; ++i) f[i] = load_f32(x, e0 + i);
        if (v < bv) pad_partial_block(f, v, dims);
      }
      encode_block<BlockOps>(block, dims, maxbits, w, iblock, u);
    }
    w.flush();
  });
}

template <int dims, typename T>
void decode_impl(const uint8_t* payload, int64_t numel, int maxbits, T* out) {
  const int bv = block_values(dims);
  const int64_t nb = num_blocks(numel, dims);
  const int64_t words = payload_words(numel, dims, maxbits);
  const int64_t grain = std::max<int64_t>(1, kGrainValues / bv);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float f[64] = {};  // (always written by decode_block; silences -Wmaybe-uninitialized)
    alignas(64) int32_t iblock[64];
    alignas(64) uint32_t u[64];
    BitReader in{payload, words, 0};
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t e0 = b * bv;
      const int v = static_cast<int>(std::min<int64_t>(bv, numel - e0));
      in.pos = b * maxbits;
      if constexpr (std::is_same_v<T, float>) {
        if (v == bv) {
          decode_block<BlockOps>(in, dims, maxbits, out + e0, iblock, u);
          continue;
        }
      }
      decode_block<BlockOps>(in, dims, maxbits, f, iblock, u);
      for (int i = 0; i < v; ++i) store_f32(out, e0 + i, f[i]);
    }
  });
}

template <typename T>
void encode_dims(const T* x, int64_t numel, int dims, int maxbits, uint8_t* payload) {
  // dims as a template argument: block size, loops and coefficient order become constants.
  switch (dims) {
    case 1: return encode_impl<1>(x, numel, maxbits, payload);
    case 2: return encode_impl<2>(x, numel, maxbits, payload);
    default: return encode_impl<3>(x, numel, maxbits, payload);
  }
}

template <typename T>
void decode_dims(const uint8_t* payload, int64_t numel, int dims, int maxbits, T* out) {
  switch (dims) {
    case 1: return decode_impl<1>(payload, numel, maxbits, out);
    case 2: return decode_impl<2>(payload, numel, maxbits, out);
    default: return decode_impl<3>(payload, numel, maxbits, out);
  }
}

}  // namespace

void encode(const void* x, CpuDtype dtype, int64_t numel, int dims, int maxbits, uint8_t* payload) {
  switch (dtype) {
    case CpuDtype::kFloat32: return encode_dims(static_cast<const float*>(x), numel, dims, maxbits, payload);
    case CpuDtype::kBFloat16: return encode_dims(static_cast<const c10::BFloat16*>(x), numel, dims, maxbits, payload);
    case CpuDtype::kFloat16: return encode_dims(static_cast<const c10::Half*>(x), numel, dims, maxbits, payload);
  }
}

void decode(const uint8_t* payload, int64_t numel, int dims, int maxbits, void* out, CpuDtype dtype) {
  switch (dtype) {
    case CpuDtype::kFloat32: return decode_dims(payload, numel, dims, maxbits, static_cast<float*>(out));
    case CpuDtype::kBFloat16: return decode_dims(payload, numel, dims, maxbits, static_cast<c10::BFloat16*>(out));
    case CpuDtype::kFloat16: return decode_dims(payload, numel, dims, maxbits, static_cast<c10::Half*>(out));
  }
}

}  // namespace ZPP_ZFP_ISA_NS
}  // namespace zpp
