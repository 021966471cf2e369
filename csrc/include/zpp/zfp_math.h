// ZFP fixed-rate block coding of float32 (1-, 2- and 3-D blocks), shared by the C++ (CPU) and CUDA
// kernels, so the CPU tests check the very code the GPU runs.
//
// The bits are zfp 1.0.1's: a payload equals what zfpy 1.0.1 writes with
// `compress_numpy(a, rate=R, write_header=False)` for the array `a` of the layout below. The format
// facts were read from zfp's documentation and sources (BSD; no code taken) and are tested against
// zfpy in tests/test_zfp.py. Design, layout and costs: megatron_zpp/compression/zfp.md.
//
// Stream: one bit sequence, written least significant bit first into 64-bit little-endian words
// (zfp's default stream word), ending with zero bits up to a whole word. Fixed rate: every block
// takes exactly `maxbits` bits, so block b starts at bit b * maxbits (random access).
// maxbits = floor(4^dims * rate + 0.5): zfpy calls zfp_stream_set_rate(.., zfp_type_none, dims,
// align=0), so there is no word alignment and no float minimum; we require maxbits >= 9.
//
// Layout (ours): a tensor of N values is read flat, C order; block b holds values
// [b * 4^dims, (b+1) * 4^dims), i.e. the array is (ceil(N/4), 4) in 2-D and (ceil(N/16), 4, 4) in 3-D
// (x fastest). The last block, when partial, is completed by zfp's own padding rule (pad_partial_block).
//
// One block (B = 4^dims values f):
//   1. emax = frexp exponent of max|f|, at least -126 (zfp clamps subnormals); all-zero block:
//      one 0 bit, then zero bits up to maxbits.
//   2. header: a 1 bit, then the 8-bit biased exponent e = emax + 127 (1..255).
//   3. block floating point: i = trunc(f * 2^(30 - emax)) as int32 (float multiply, exact here).
//      zfp computes 2^(30 - emax) with ldexpf, which overflows to +inf for emax <= -98 (blocks whose
//      largest magnitude is below 2^-97); f * inf then converts to int32 as x86 does, INT32_MIN for
//      every value. We reproduce that (zfpy does it); such blocks decode to garbage of magnitude <= 2^-97.
//   4. forward decorrelating transform: the lifting step fwd_lift along x, then y, then z (int32,
//      arithmetic shifts; wrap-around where zfp's C arithmetic would overflow, i.e. only for step 3's
//      INT32_MIN blocks or corrupt input).
//   5. coefficients reordered by sequency (kPerm2 / kPerm3), mapped to negabinary (u = (i + M) ^ M,
//      M = 0xaaaaaaaa).
//   6. embedded coding, bit plane 31 down to 0, with n = coefficients already significant (starts 0):
//      the plane's first n bits verbatim, then group tests over the rest: "0" = no more ones in this
//      plane (plane done); "1" = at least one: then its bits one by one up to and including the next
//      one-bit, whose position joins the significant set (the last position's one is implicit).
//      The block's code is cut at maxbits (fixed rate) and zero-filled when shorter.
// Decoding reverses it exactly as zfp's decoder does, including its guess when the budget ends inside
// a group's scan (the next unread position is taken as the one-bit).
//
// Non-finite values (ours; zfp has no rule): zfp ignores NaN when taking the block maximum and takes
// frexp(inf) = 0 for Inf, then converts NaN/Inf to int32 (undefined in C; INT32_MIN on x86), so a
// block with NaN/Inf comes back as finite garbage. We encode such a block as the header bit 1 with
// exponent field 0, a code zfp never writes for float (a non-zero block has e >= 1), then zero bits;
// our decoder turns that code into NaN for the whole block, so Megatron's overflow check sees it. A
// stock zfp decoder reads it as exponent -127 with zero coefficients: a block of zeros.
//
// Numerics: every float operation is an exactly specified IEEE one (multiply by a power of two,
// int <-> float conversions); device code uses the _rn/_rz intrinsics.
#pragma once

#if defined(__FAST_MATH__)
#error "zpp/zfp_math.h: -ffast-math changes float semantics; the kernels must match zfp bit for bit"
#endif

#include <stdint.h>
#include <string.h>  // memcpy (host paths)

// Like quant_math.h's ZPP_HD, but always inlined on the host too: the CPU kernels are compiled once per
// instruction-set level (zfp_cpu_isa.h), and only code inlined into those copies gets their instructions.
#if defined(__CUDACC__)
#define ZPP_ZFP_HD __host__ __device__ __forceinline__
#else
#define ZPP_ZFP_HD inline __attribute__((always_inline))
#endif

namespace zpp {
namespace zfp {

constexpr int kExpBits = 8;
constexpr int kExpBias = 127;
constexpr int kHeaderBits = 1 + kExpBits;  // non-zero flag + biased exponent
constexpr int kIntPrec = 32;               // bit planes of a float32 block's coefficients
constexpr uint32_t kNegabinaryMask = 0xaaaaaaaau;
constexpr int kMinMaxbits = kHeaderBits;   // below this zfp's own coder misbehaves (budget underflow)
constexpr int kMaxMaxbits = 64 * 64;       // 3-D at 64 bits/value; rates are validated far below
// Biased exponents <= this give emax <= -98, where zfp's scale 2^(30 - emax) overflows float.
constexpr int kOverflowBiasedExponent = 29;

ZPP_ZFP_HD int block_values(int dims) { return 1 << (2 * dims); }
ZPP_ZFP_HD int64_t num_blocks(int64_t numel, int dims) {
  const int64_t b = block_values(dims);
  return (numel + b - 1) / b;
}
ZPP_ZFP_HD int64_t payload_words(int64_t numel, int dims, int64_t maxbits) {
  return (num_blocks(numel, dims) * maxbits + 63) / 64;
}
ZPP_ZFP_HD int64_t payload_bytes(int64_t numel, int dims, int64_t maxbits) { return 8 * payload_words(numel, dims, maxbits); }
// Blocks per "chunk": the fewest consecutive blocks that fill whole 64-bit words, so chunks can be
// written in parallel without sharing a word. 64 / gcd(maxbits, 64).
ZPP_ZFP_HD int64_t chunk_blocks(int64_t maxbits) {
  int64_t low = maxbits & -maxbits;  // largest power of two dividing maxbits
  return low >= 64 ? 1 : 64 / low;
}

// ---------------------------------------------------------------- bits ----
ZPP_ZFP_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
ZPP_ZFP_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}
ZPP_ZFP_HD int ctz64(uint64_t x) {  // x != 0
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(x)) - 1;
#else
  return __builtin_ctzll(x);
#endif
}
ZPP_ZFP_HD int clz32(uint32_t x) {  // x != 0
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(x));
#else
  return __builtin_clz(x);
#endif
}
ZPP_ZFP_HD uint64_t low_mask(int n) { return n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1; }

// ------------------------------------------------------------- padding ----
// zfp's rule for a run of n < 4 values at stride s (missing values copied from present ones, which
// keeps the transform's high-order coefficients small): n=1: a a a a; n=2: a b b a; n=3: a b c a.
ZPP_ZFP_HD void pad4(float* p, int n, int s) {
  if (n == 0) p[0] = 0.0f;
  if (n <= 1) p[s] = p[0];
  if (n <= 2) p[2 * s] = p[s];
  if (n <= 3) p[3 * s] = p[0];
}

// Completes a block whose first v (0 < v < 4^dims) values are present, as zfp completes a partial
// block of our layout: the partial row along x, then the partial plane's missing rows along y, then
// the missing planes along z. (Equivalently: the flat tail is padded to whole rows / planes by this
// rule and zfp pads the rest itself; zfp.md.)
ZPP_ZFP_HD void pad_partial_block(float* q, int v, int dims) {
  if (dims == 1) {
    pad4(q, v, 1);
    return;
  }
  const int plane = dims == 2 ? 0 : v / 16;  // index of the partial 4x4 plane (2-D: the only one)
  const int w = dims == 2 ? v : v % 16;      // values present in it
  if (w > 0) {
    float* p = q + 16 * plane;
    if (w % 4) pad4(p + 4 * (w / 4), w % 4, 1);
    for (int x = 0; x < 4; ++x) pad4(p + x, (w + 3) / 4, 4);
  }
  if (dims == 3)
    for (int i = 0; i < 16; ++i) pad4(q + i, (v + 15) / 16, 16);
}

// ------------------------------------------------- block floating point ----
// Biased exponent field of a block from the bit pattern of its largest |value| (finite): 0 for an
// all-zero block, else frexp's exponent of the max (clamped at -126 for subnormals) + 127.
ZPP_ZFP_HD int biased_exponent(uint32_t max_abs_bits) {
  if (max_abs_bits == 0) return 0;
  const int field = static_cast<int>(max_abs_bits >> 23);
  return field == 0 ? 1 : field + 1;
}

// The cast scale 2^(30 - emax) for emax > -98 (a normal float: exponent field 157 - emax in [29, 254]).
ZPP_ZFP_HD float cast_scale(int emax) { return f32_from_bits(static_cast<uint32_t>(157 - emax) << 23); }

ZPP_ZFP_HD int32_t cast_to_int(float f, float scale) {
#if defined(__CUDA_ARCH__)
  return __float2int_rz(__fmul_rn(f, scale));
#else
  return static_cast<int32_t>(f * scale);  // |f * scale| < 2^30: in range, truncates toward zero
#endif
}

// ldexpf(1, emax - 30) as zfp's decoder computes it: normal, subnormal, or 0 below 2^-149.
ZPP_ZFP_HD float uncast_scale(int emax) {
  const int n = emax - 30;
  if (n >= -126) return f32_from_bits(static_cast<uint32_t>(n + 127) << 23);
  if (n >= -149) return f32_from_bits(uint32_t(1) << (n + 149));
  return 0.0f;
}

ZPP_ZFP_HD float uncast(int32_t i, float scale) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__int2float_rn(i), scale);
#else
  return static_cast<float>(i) * scale;
#endif
}

// ------------------------------------------------------------- lifting ----
// int32 add/sub/shift with two's-complement wrap-around (what zfp's compiled C does where it would
// overflow); >> on a negative int32 is arithmetic (C++20, and every compiler we build with).
ZPP_ZFP_HD int32_t wadd(int32_t a, int32_t b) { return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b)); }
ZPP_ZFP_HD int32_t wsub(int32_t a, int32_t b) { return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b)); }
ZPP_ZFP_HD int32_t wshl1(int32_t a) { return static_cast<int32_t>(static_cast<uint32_t>(a) << 1); }

// Forward lifting of one 4-vector (x, y, z, w) at stride s: zfp's non-orthogonal decorrelating
// transform, 1/16 * [4 4 4 4; 5 1 -1 -5; -4 4 4 -4; -2 6 -6 2], in integer lifting steps.
ZPP_ZFP_HD void fwd_lift(int32_t* p, int s) {
  int32_t x = p[0], y = p[s], z = p[2 * s], w = p[3 * s];
  x = wadd(x, w); x >>= 1; w = wsub(w, x);
  z = wadd(z, y); z >>= 1; y = wsub(y, z);
  x = wadd(x, z); x >>= 1; z = wsub(z, x);
  w = wadd(w, y); w >>= 1; y = wsub(y, w);
  w = wadd(w, y >> 1); y = wsub(y, w >> 1);
  p[0] = x; p[s] = y; p[2 * s] = z; p[3 * s] = w;
}

// Its inverse (exact on what fwd_lift produces).
ZPP_ZFP_HD void inv_lift(int32_t* p, int s) {
  int32_t x = p[0], y = p[s], z = p[2 * s], w = p[3 * s];
  y = wadd(y, w >> 1); w = wsub(w, y >> 1);
  y = wadd(y, w); w = wshl1(w); w = wsub(w, y);
  z = wadd(z, x); x = wshl1(x); x = wsub(x, z);
  y = wadd(y, z); z = wshl1(z); z = wsub(z, y);
  w = wadd(w, x); x = wshl1(x); x = wsub(x, w);
  p[0] = x; p[s] = y; p[2 * s] = z; p[3 * s] = w;
}

// Separable transforms: forward along x, then y, then z; inverse in the opposite order.
ZPP_ZFP_HD void fwd_xform(int32_t* p, int dims) {
  if (dims == 1) {
    fwd_lift(p, 1);
  } else if (dims == 2) {
    for (int y = 0; y < 4; ++y) fwd_lift(p + 4 * y, 1);
    for (int x = 0; x < 4; ++x) fwd_lift(p + x, 4);
  } else {
    for (int r = 0; r < 16; ++r) fwd_lift(p + 4 * r, 1);  // rows (y, z)
    for (int z = 0; z < 4; ++z)
      for (int x = 0; x < 4; ++x) fwd_lift(p + 16 * z + x, 4);
    for (int i = 0; i < 16; ++i) fwd_lift(p + i, 16);  // columns (x, y)
  }
}

ZPP_ZFP_HD void inv_xform(int32_t* p, int dims) {
  if (dims == 1) {
    inv_lift(p, 1);
  } else if (dims == 2) {
    for (int x = 0; x < 4; ++x) inv_lift(p + x, 4);
    for (int y = 0; y < 4; ++y) inv_lift(p + 4 * y, 1);
  } else {
    for (int i = 0; i < 16; ++i) inv_lift(p + i, 16);
    for (int z = 0; z < 4; ++z)
      for (int x = 0; x < 4; ++x) inv_lift(p + 16 * z + x, 4);
    for (int r = 0; r < 16; ++r) inv_lift(p + 4 * r, 1);
  }
}

// ------------------------------------------------------ sequency order ----
// Coefficient (i, j, k) sits at i + 4j + 16k after the transform. zfp codes them by total degree
// i+j+k, then by i^2+j^2+k^2, with its own order among ties; kPerm2 / kPerm3 are that order (a format
// constant; the static_asserts below check the sort keys, the zfpy tests the tie order). kInvPerm*
// are their inverses (position -> coding index). 1-D is the identity.
#define ZPP_ZFP_PERM2 0, 1, 4, 5, 2, 8, 6, 9, 3, 12, 10, 7, 13, 11, 14, 15
#define ZPP_ZFP_PERM3                                                                                       \
  0, 1, 4, 16, 20, 17, 5, 2, 8, 32, 21, 6, 18, 24, 9, 33, 36, 3, 12, 48, 22, 25, 37, 40, 34, 10, 7, 19, 28, \
      13, 49, 52, 41, 38, 26, 23, 29, 53, 11, 35, 44, 14, 50, 56, 42, 27, 39, 45, 30, 54, 57, 60, 51, 15, 43, \
      46, 58, 61, 55, 31, 62, 59, 47, 63
#define ZPP_ZFP_INV_PERM2 0, 1, 4, 8, 2, 3, 6, 11, 5, 7, 10, 13, 9, 12, 14, 15
#define ZPP_ZFP_INV_PERM3                                                                                  \
  0, 1, 7, 17, 2, 6, 11, 26, 8, 14, 25, 38, 18, 29, 41, 53, 3, 5, 12, 27, 4, 10, 20, 35, 13, 21, 34, 45, 28, \
      36, 48, 59, 9, 15, 24, 39, 16, 22, 33, 46, 23, 32, 44, 54, 40, 47, 55, 62, 19, 30, 42, 52, 31, 37, 49, \
      58, 43, 50, 56, 61, 51, 57, 60, 63

#if defined(__CUDACC__)
static __constant__ const uint8_t kPerm2Device[16] = {ZPP_ZFP_PERM2};
static __constant__ const uint8_t kPerm3Device[64] = {ZPP_ZFP_PERM3};
static __constant__ const uint8_t kInvPerm2Device[16] = {ZPP_ZFP_INV_PERM2};
static __constant__ const uint8_t kInvPerm3Device[64] = {ZPP_ZFP_INV_PERM3};
#endif
inline constexpr uint8_t kPerm2[16] = {ZPP_ZFP_PERM2};
inline constexpr uint8_t kPerm3[64] = {ZPP_ZFP_PERM3};
inline constexpr uint8_t kInvPerm2[16] = {ZPP_ZFP_INV_PERM2};
inline constexpr uint8_t kInvPerm3[64] = {ZPP_ZFP_INV_PERM3};

// (degree, sum of squares) never decreases along the order, and the inverse tables invert it.
constexpr bool perm_is_sequency_order(const uint8_t* perm, int n) {
  int last_degree = 0, last_squares = 0;
  for (int c = 0; c < n; ++c) {
    const int i = perm[c] % 4, j = perm[c] / 4 % 4, k = perm[c] / 16;
    const int degree = i + j + k, squares = i * i + j * j + k * k;
    if (degree < last_degree || (degree == last_degree && squares < last_squares)) return false;
    last_degree = degree;
    last_squares = squares;
  }
  return true;
}
constexpr bool inverts(const uint8_t* perm, const uint8_t* inv, int n) {
  for (int c = 0; c < n; ++c)
    if (perm[c] >= n || inv[perm[c]] != c) return false;
  return true;
}
static_assert(perm_is_sequency_order(kPerm2, 16) && perm_is_sequency_order(kPerm3, 64));
static_assert(inverts(kPerm2, kInvPerm2, 16) && inverts(kPerm3, kInvPerm3, 64));

// Position (after the transform) of the c-th coded coefficient, and the coding index of position i.
ZPP_ZFP_HD int coded_position(int c, int dims) {
#if defined(__CUDA_ARCH__)
  return dims == 1 ? c : dims == 2 ? kPerm2Device[c] : kPerm3Device[c];
#else
  return dims == 1 ? c : dims == 2 ? kPerm2[c] : kPerm3[c];
#endif
}
ZPP_ZFP_HD int coding_index(int i, int dims) {
#if defined(__CUDA_ARCH__)
  return dims == 1 ? i : dims == 2 ? kInvPerm2Device[i] : kInvPerm3Device[i];
#else
  return dims == 1 ? i : dims == 2 ? kInvPerm2[i] : kInvPerm3[i];
#endif
}

ZPP_ZFP_HD uint32_t to_negabinary(int32_t i) { return (static_cast<uint32_t>(i) + kNegabinaryMask) ^ kNegabinaryMask; }
ZPP_ZFP_HD int32_t from_negabinary(uint32_t u) { return static_cast<int32_t>((u ^ kNegabinaryMask) - kNegabinaryMask); }

// ------------------------------------------------------------- bit I/O ----
ZPP_ZFP_HD void store_word(uint8_t* p, uint64_t w) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint64_t*>(p) = w;  // payloads are 8-byte aligned on the GPU (checked by the binding)
#else
  memcpy(p, &w, 8);  // little-endian hosts only (x86-64, aarch64): zfp's words are native-endian
#endif
}
ZPP_ZFP_HD uint64_t load_word(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint64_t*>(p);
#else
  uint64_t w;
  memcpy(&w, p, 8);
  return w;
#endif
}

// Appends bits to 64-bit words from a word boundary; flush() writes the last, partial word.
struct WordWriter {
  uint8_t* out;
  uint64_t buf = 0;
  int fill = 0;  // bits in buf, < 64

  ZPP_ZFP_HD explicit WordWriter(uint8_t* o) : out(o) {}
  // The n (<= 64) low bits of v, which must have no bits above them.
  ZPP_ZFP_HD void put(uint64_t v, int n) {
    buf |= v << fill;  // fill < 64
    fill += n;
    if (fill >= 64) {
      store_word(out, buf);
      out += 8;
      fill -= 64;
      buf = fill ? v >> (n - fill) : 0;
    }
  }
  ZPP_ZFP_HD void zeros(int64_t n) {
    for (; n > 0; n -= 64) put(0, n < 64 ? static_cast<int>(n) : 64);
  }
  ZPP_ZFP_HD void flush() {
    if (fill) store_word(out, buf);
    out += 8 * (fill != 0);
    buf = 0;
    fill = 0;
  }
};

// A block's bits, cut at its budget: put() keeps only what fits; the rest of the code is dropped,
// which is exactly zfp's fixed-rate truncation (its coder emits a prefix of the same sequence).
struct BudgetWriter {
  WordWriter& w;
  int left;
  ZPP_ZFP_HD BudgetWriter(WordWriter& writer, int budget) : w(writer), left(budget) {}
  ZPP_ZFP_HD void put(uint64_t v, int n) {
    if (n > left) {
      n = left;
      v &= low_mask(n);
    }
    w.put(v, n);
    left -= n;
  }
  ZPP_ZFP_HD void pad() {
    w.zeros(left);
    left = 0;
  }
};

// Reads bits from any bit offset of a payload of `words` words (never past its end).
struct BitReader {
  const uint8_t* base;
  int64_t words;
  int64_t pos;  // bit position

  // The 64 bits starting at pos (zeros past the end).
  ZPP_ZFP_HD uint64_t peek() const {
    const int64_t i = pos >> 6;
    const int sh = static_cast<int>(pos & 63);
    uint64_t v = i < words ? load_word(base + 8 * i) >> sh : 0;
    if (sh && i + 1 < words) v |= load_word(base + 8 * (i + 1)) << (64 - sh);
    return v;
  }
  ZPP_ZFP_HD uint64_t get(int n) {  // n <= 64
    if (n == 0) return 0;
    const uint64_t v = peek() & low_mask(n);
    pos += n;
    return v;
  }
};

// A 64-bit window on a BitReader: most reads are a shift and a mask; refills when a read would
// run past the window. Call sync() before using the reader directly again.
struct BitWindow {
  BitReader& in;
  uint64_t win;
  int used = 0;  // bits of win consumed, <= 64
  ZPP_ZFP_HD explicit BitWindow(BitReader& r) : in(r), win(r.peek()) {}
  ZPP_ZFP_HD void ensure(int n) {  // n <= 64
    if (used + n > 64) {
      in.pos += used;
      win = in.peek();
      used = 0;
    }
  }
  ZPP_ZFP_HD uint64_t look(int n) {  // the next n bits, not consumed
    ensure(n);
    return used < 64 ? (win >> used) & low_mask(n) : 0;
  }
  ZPP_ZFP_HD void skip(int n) { used += n; }  // after look(>= n)
  ZPP_ZFP_HD uint64_t get(int n) {
    const uint64_t v = look(n);
    used += n;
    return v;
  }
  ZPP_ZFP_HD void sync() {
    in.pos += used;
    used = 0;
  }
};

// The per-block steps a CPU level may vectorize, plain versions (CUDA, CPU baseline); the vectorized
// ones (csrc/cpu/zfp_cpu_isa.h) must give the same results:
//   forward(f, e, dims, i, u)  steps 3-5 for a finite non-zero block of biased exponent e: f (B
//                              values) -> u (B negabinary coefficients in coding order); i: scratch
//   inverse(u, e, dims, i, f)  their inverse (decode)
//   extract(u, size, k)        the mask of bit k of `size` (<= 64) coefficients (bit c = coefficient c)
//   deposit(u, size, k, x)     adds plane k back
//   kTableSteps4               1-D planes by table steps (see the embedded coder)
// The CPU baseline level runs exactly this plain path, the CUDA kernels' path, so the zfpy tests
// check it on every CI run.
struct BlockOpsScalar {
  static constexpr bool kTableSteps4 = false;
  static ZPP_ZFP_HD void forward(const float* f, int e, int dims, int32_t* iblock, uint32_t* u) {
    const int size = block_values(dims);
    if (e <= kOverflowBiasedExponent) {
      for (int i = 0; i < size; ++i) iblock[i] = INT32_MIN;  // zfp: f * inf -> int32 (x86: INT32_MIN)
    } else {
      const float s = cast_scale(e - kExpBias);
      for (int i = 0; i < size; ++i) iblock[i] = cast_to_int(f[i], s);
    }
    fwd_xform(iblock, dims);
    for (int c = 0; c < size; ++c) u[c] = to_negabinary(iblock[coded_position(c, dims)]);
  }
  static ZPP_ZFP_HD void inverse(const uint32_t* u, int e, int dims, int32_t* iblock, float* f) {
    const int size = block_values(dims);  // gather form: sequential stores, then vector loads
    for (int i = 0; i < size; ++i) iblock[i] = from_negabinary(u[coding_index(i, dims)]);
    inv_xform(iblock, dims);
    const float s = uncast_scale(e - kExpBias);
    for (int i = 0; i < size; ++i) f[i] = uncast(iblock[i], s);
  }
  static ZPP_ZFP_HD uint64_t extract(const uint32_t* u, int size, int k) {
    uint64_t x = 0;
    for (int c = 0; c < size; ++c) x |= static_cast<uint64_t>((u[c] >> k) & 1u) << c;
    return x;
  }
  static ZPP_ZFP_HD void deposit(uint32_t* u, int size, int k, uint64_t x) {
    for (int c = 0; c < size; ++c) u[c] += static_cast<uint32_t>((x >> c) & 1u) << k;
  }
};

// ------------------------------------------------------- embedded coder ----
// 1-D blocks (4 coefficients) can take one table step per bit plane instead of the bit-level loops
// below (Ops::kTableSteps4: the vectorized CPU levels; the plain path, which CUDA and the CPU baseline
// level run, keeps the loops); the tables are computed at compile time from the same rules (plane_code4 /
// plane_decode4 follow encode_planes / decode_planes for one plane with an unlimited budget) and the
// zfpy tests cover them at every CPU level. Within a block's budget the encoder cuts the table's code
// like any other (BudgetWriter); the decoder uses a table step only while the budget holds the longest
// plane code (7 bits) and finishes with the bit-level loop, which reproduces zfp's truncation.
struct PlaneStep4 {
  uint8_t bits;   // encode: the plane's code (LSB first); decode: the plane's 4 bits
  uint8_t len;    // code length
  uint8_t n;      // significant coefficients after the plane
};
constexpr int kPlaneCode4Max = 7;

constexpr PlaneStep4 plane_code4(int n, int x) {  // x: bit k of the 4 coefficients
  int code = x & ((1 << n) - 1), len = n;
  x >>= n;
  while (n < 4) {
    if (x == 0) {
      len += 1;  // "0": plane done
      break;
    }
    int t = 0;
    while (!((x >> t) & 1)) ++t;
    if (n + t == 3) {
      code |= 1 << len;  // "1", t zeros (last position implied)
      len += 1 + t;
      n = 4;
    } else {
      code |= (1 | (1 << (t + 1))) << len;  // "1", t zeros, "1"
      len += t + 2;
      n += t + 1;
      x >>= t + 1;
    }
  }
  return {static_cast<uint8_t>(code), static_cast<uint8_t>(len), static_cast<uint8_t>(n)};
}

constexpr PlaneStep4 plane_decode4(int n, int code) {  // code: the next 7 stream bits
  int x = code & ((1 << n) - 1), pos = n;
  while (n < 4) {
    if (!((code >> pos++) & 1)) break;  // negative group test
    const int limit = 3 - n;
    int t = 0;
    while (t < limit && !((code >> (pos + t)) & 1)) ++t;
    pos += t < limit ? t + 1 : limit;
    n += t;
    x |= 1 << n;
    ++n;
  }
  return {static_cast<uint8_t>(x), static_cast<uint8_t>(pos), static_cast<uint8_t>(n)};
}

struct PlaneTables4 {
  PlaneStep4 code[5][16];
  PlaneStep4 decode[5][1 << kPlaneCode4Max];
};
constexpr PlaneTables4 make_plane_tables4() {
  PlaneTables4 t{};
  for (int n = 0; n <= 4; ++n) {
    for (int x = 0; x < 16; ++x) t.code[n][x] = plane_code4(n, x);
    for (int c = 0; c < (1 << kPlaneCode4Max); ++c) t.decode[n][c] = plane_decode4(n, c);
  }
  return t;
}
inline constexpr PlaneTables4 kPlaneTables4 = make_plane_tables4();
static_assert(plane_code4(0, 15).len == kPlaneCode4Max && plane_decode4(0, 0x7f).len == kPlaneCode4Max);

// One bit plane x (bit c = coefficient c) with n coefficients significant so far; updates n. kChecked:
// cut the code at out's budget (otherwise the caller guarantees it fits).
template <bool kChecked>
ZPP_ZFP_HD void code_plane(BudgetWriter& out, uint64_t x, int& n, int size) {
  auto put = [&out](uint64_t v, int len) {
    if (kChecked) {
      out.put(v, len);
    } else {
      out.w.put(v, len);
      out.left -= len;
    }
  };
  put(x & low_mask(n), n);
  x = n < 64 ? x >> n : 0;
  while (n < size && (!kChecked || out.left > 0)) {
    if (x == 0) {
      put(0, 1);  // negative group test: the plane is done
      break;
    }
    const int t = ctz64(x);  // zeros before the next one-bit
    if (n + t == size - 1) {
      put(1, 1 + t);  // "1", t zeros; the last position's one is implied
      n = size;
    } else {
      put(1 | (uint64_t(1) << (t + 1)), t + 2);  // "1", t zeros, "1"
      n += t + 1;
      x >>= t + 1;
    }
  }
}

// Codes `size` negabinary coefficients, plane 31 down to 0, into out (cut at its budget). See step 6
// in the header comment.
template <typename Ops>
ZPP_ZFP_HD void encode_planes(BudgetWriter& out, const uint32_t* u, int size) {
  uint32_t any = 0;
  for (int c = 0; c < size; ++c) any |= u[c];
  if (any == 0) return;  // (zfp would send one 0 per plane; the zero fill that follows is the same)
  // Planes above the highest one-bit are empty while nothing is significant yet: one 0 each.
  const int top = 31 - clz32(any);
  out.put(0, kIntPrec - 1 - top);
  int n = 0;  // significant coefficients: their bits are sent verbatim
  if constexpr (Ops::kTableSteps4) {  // (constexpr: device code never names the host tables)
    if (size == 4) {
      for (int k = top; k >= 0 && out.left > 0; --k) {
        const int x = static_cast<int>(((u[0] >> k) & 1) | (((u[1] >> k) & 1) << 1) | (((u[2] >> k) & 1) << 2) |
                                       (((u[3] >> k) & 1) << 3));
        const PlaneStep4 step = kPlaneTables4.code[n][x];
        out.put(step.bits, step.len);
        n = step.n;
      }
      return;
    }
  }
  for (int k = top; k >= 0 && out.left > 0; --k) {
    const uint64_t x = Ops::extract(u, size, k);
    // A plane's code is at most 2 * size + 1 bits: while that fits, skip the per-write budget check.
    if (out.left > 2 * size + 1)
      code_plane<false>(out, x, n, size);
    else
      code_plane<true>(out, x, n, size);
  }
}

// Decodes `size` coefficients from `budget` bits, exactly as zfp's decoder (including its guess
// when the budget ends inside a group's scan: the next unread position gets the one-bit).
template <typename Ops>
ZPP_ZFP_HD void decode_planes(BitReader& reader, int budget, uint32_t* u, int size) {
  for (int c = 0; c < size; ++c) u[c] = 0;
  BitWindow in(reader);
  int bits = budget, n = 0, k = kIntPrec - 1;
  if constexpr (Ops::kTableSteps4) {
    if (size == 4) {  // table steps while the budget holds any plane's code; locals, not memory
      uint32_t u0 = 0, u1 = 0, u2 = 0, u3 = 0;
      for (; bits >= kPlaneCode4Max && k >= 0; --k) {
        const PlaneStep4 step = kPlaneTables4.decode[n][in.look(kPlaneCode4Max)];
        in.skip(step.len);
        bits -= step.len;
        n = step.n;
        u0 |= uint32_t(step.bits & 1) << k;
        u1 |= uint32_t((step.bits >> 1) & 1) << k;
        u2 |= uint32_t((step.bits >> 2) & 1) << k;
        u3 |= uint32_t((step.bits >> 3) & 1) << k;
      }
      u[0] = u0, u[1] = u1, u[2] = u2, u[3] = u3;
    }
  }
  for (; bits > 0 && k >= 0; --k) {
    const int m = n < bits ? n : bits;
    bits -= m;
    uint64_t x = in.get(m);
    while (bits > 0 && n < size) {
      --bits;
      if (!in.get(1)) break;  // negative group test
      // Scan for the next one-bit among positions n..size-2, as far as the budget goes.
      const int limit = (size - 1 - n) < bits ? (size - 1 - n) : bits;
      const uint64_t ahead = in.look(limit);
      const int t = ahead ? ctz64(ahead) : limit;
      const int consumed = ahead ? t + 1 : limit;
      in.skip(consumed);
      bits -= consumed;
      n += t;
      x += uint64_t(1) << n;
      ++n;
    }
    if (x) Ops::deposit(u, size, k, x);
  }
  in.sync();
}

// ---------------------------------------------------------- one block ----
// Max |f| as a bit pattern over n values; non-finite iff >= 0x7f800000.
ZPP_ZFP_HD uint32_t max_abs_bits(const float* f, int n) {
  uint32_t m = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t b = f32_bits(f[i]) & 0x7fffffffu;
    m = m > b ? m : b;
  }
  return m;
}

// Writes one whole block (exactly maxbits bits). f: B values (padded). scratch: B int32 + B uint32.
// Pass dims as a compile-time constant where speed matters: everything here is inlined.
template <typename Ops = BlockOpsScalar>
ZPP_ZFP_HD void encode_block(const float* f, int dims, int maxbits, WordWriter& w, int32_t* iblock, uint32_t* u) {
  const int size = block_values(dims);
  BudgetWriter out(w, maxbits);
  const uint32_t m = max_abs_bits(f, size);
  if (m >= 0x7f800000u) {
    out.put(1, kHeaderBits);  // non-finite marker: flag 1, exponent field 0
  } else if (m == 0) {
    out.put(0, 1);
  } else {
    const int e = biased_exponent(m);
    out.put(2 * static_cast<uint64_t>(e) + 1, kHeaderBits);
    Ops::forward(f, e, dims, iblock, u);
    encode_planes<Ops>(out, u, size);
  }
  out.pad();
}

// Reads the block at the reader's position into f (B values). scratch as for encode_block.
template <typename Ops = BlockOpsScalar>
ZPP_ZFP_HD void decode_block(BitReader& in, int dims, int maxbits, float* f, int32_t* iblock, uint32_t* u) {
  const int size = block_values(dims);
  const uint64_t head = in.get(kHeaderBits);  // (when the flag is 0 the rest is not looked at)
  if (!(head & 1)) {
    for (int i = 0; i < size; ++i) f[i] = 0.0f;
    return;
  }
  const int e = static_cast<int>(head >> 1);
  if (e == 0) {  // our non-finite marker
    const float nan = f32_from_bits(0x7fc00000u);
    for (int i = 0; i < size; ++i) f[i] = nan;
    return;
  }
  decode_planes<Ops>(in, maxbits - kHeaderBits, u, size);
  Ops::inverse(u, e, dims, iblock, f);
}

}  // namespace zfp
}  // namespace zpp
