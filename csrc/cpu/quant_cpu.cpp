// CPU kernels of the blocked INT8/INT4 ops (C++, OpenMP over blocks via
// at::parallel_for). The bits they produce are defined by zpp/quant_math.h and
// checked against megatron_zpp/compression/reference.py in tests/.
//
// Vectorization: the per-block loops (quant_cpu_isa.h) are written lane-wise
// (fixed-width partial max/NaN accumulators, branch-free rounding) so GCC emits
// SIMD at -O3 without -ffast-math; -ffp-contract=off keeps multiply/add separate
// like the reference.
//
// Portable build, fast loops: the extension is compiled for the baseline of
// its architecture (no -march=native: a build shared by a login node and
// compute nodes must run on both). On x86-64 with GCC the loops are compiled
// three times (baseline SSE2, x86-64-v3 = AVX2+F16C, x86-64-v4 = AVX-512) and
// the best level the CPU supports is picked on first use. ZPP_CPU_ISA=<level>
// forces a level (e.g. to compare them); torch.ops.megatron_zpp._cpu_isa()
// names the level in use and _set_cpu_isa(level) switches (tests, benchmarks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "zpp/op_checks.h"
#include "zpp/quant_chunks.h"
#include "zpp/quant_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZPP_CPU_X86_LEVELS 1
#include <immintrin.h>
#else
#define ZPP_CPU_X86_LEVELS 0
#endif

namespace zpp {

enum class CpuDtype { kFloat32, kBFloat16, kFloat16 };

struct RowReorder {  // qgZ: input row r goes to row reorder_slot_of_input_row(r, ...)
  int64_t stages, node_size, nodes;
};

}  // namespace zpp

// ------------------------------------------------ the loops, per level ------
#define ZPP_CPU_ISA_NS isa_baseline
#define ZPP_CPU_ISA_F16C 0
#define ZPP_CPU_ISA_AVX2 0
#define ZPP_CPU_ISA_AVX512 0
#include "quant_cpu_isa.h"
#undef ZPP_CPU_ISA_NS
#undef ZPP_CPU_ISA_F16C
#undef ZPP_CPU_ISA_AVX2
#undef ZPP_CPU_ISA_AVX512

#if ZPP_CPU_X86_LEVELS
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define ZPP_CPU_ISA_NS isa_x86_64_v3
#define ZPP_CPU_ISA_F16C 1
#define ZPP_CPU_ISA_AVX2 1
#define ZPP_CPU_ISA_AVX512 0
#include "quant_cpu_isa.h"
#undef ZPP_CPU_ISA_NS
#undef ZPP_CPU_ISA_F16C
#undef ZPP_CPU_ISA_AVX2
#undef ZPP_CPU_ISA_AVX512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define ZPP_CPU_ISA_NS isa_x86_64_v4
#define ZPP_CPU_ISA_F16C 1
#define ZPP_CPU_ISA_AVX2 1
#define ZPP_CPU_ISA_AVX512 1
#include "quant_cpu_isa.h"
#undef ZPP_CPU_ISA_NS
#undef ZPP_CPU_ISA_F16C
#undef ZPP_CPU_ISA_AVX2
#undef ZPP_CPU_ISA_AVX512
#pragma GCC pop_options
#endif

namespace zpp {
namespace {

// ------------------------------------------------- run-time selection ------
struct CpuKernels {
  const char* name;
  bool (*supported)();
  decltype(&isa_baseline::quantize_rows) quantize_rows;
  decltype(&isa_baseline::dequantize_rows) dequantize_rows;
  decltype(&isa_baseline::dequant_reduce_quantize) dequant_reduce_quantize;
  decltype(&isa_baseline::dequant_reduce) dequant_reduce;
};

#define ZPP_CPU_KERNELS(NAME, NS, SUPPORTED) \
  CpuKernels { NAME, SUPPORTED, &NS::quantize_rows, &NS::dequantize_rows, &NS::dequant_reduce_quantize, &NS::dequant_reduce }

// Lowest level first.
const CpuKernels kCpuLevels[] = {
#if ZPP_CPU_X86_LEVELS
    ZPP_CPU_KERNELS("x86-64", isa_baseline, [] { return true; }),
    ZPP_CPU_KERNELS("x86-64-v3", isa_x86_64_v3, [] { return __builtin_cpu_supports("x86-64-v3") != 0; }),
    ZPP_CPU_KERNELS("x86-64-v4", isa_x86_64_v4, [] { return __builtin_cpu_supports("x86-64-v4") != 0; }),
#else
    ZPP_CPU_KERNELS("baseline", isa_baseline, [] { return true; }),
#endif
};
constexpr int kNumCpuLevels = sizeof(kCpuLevels) / sizeof(kCpuLevels[0]);

std::vector<std::string> supported_levels() {
#if ZPP_CPU_X86_LEVELS
  __builtin_cpu_init();
#endif
  std::vector<std::string> names;
  for (const auto& k : kCpuLevels)
    if (k.supported()) names.emplace_back(k.name);
  return names;
}

int level_index(const std::string& name) {
  for (int i = 0; i < kNumCpuLevels; ++i)
    if (name == kCpuLevels[i].name) {
      TORCH_CHECK(kCpuLevels[i].supported(), "megatron_zpp: this CPU does not support the ", name,
                  " kernels; supported: ", c10::Join(", ", supported_levels()));
      return i;
    }
  TORCH_CHECK(false, "megatron_zpp: unknown CPU kernel level '", name, "'; supported here: ",
              c10::Join(", ", supported_levels()));
}

int default_level() {
  const char* env = std::getenv("ZPP_CPU_ISA");
  if (env != nullptr && *env != '\0') return level_index(env);
  const auto names = supported_levels();
  return level_index(names.back());
}

std::atomic<int> g_level{-1};

const CpuKernels& cpu_kernels() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    level = default_level();
    g_level.store(level, std::memory_order_relaxed);
  }
  return kCpuLevels[level];
}

std::string cpu_isa() { return cpu_kernels().name; }

std::string set_cpu_isa(const std::string& name) {
  const std::string previous = cpu_isa();
  g_level.store(level_index(name), std::memory_order_relaxed);
  return previous;
}

std::vector<std::string> cpu_isas() { return supported_levels(); }

CpuDtype cpu_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return CpuDtype::kFloat32;
    case at::kBFloat16: return CpuDtype::kBFloat16;
    default: return CpuDtype::kFloat16;  // check_float() ran first
  }
}

// ------------------------------------------------------------ op bodies -----
void quantize_rows_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block, bool stochastic,
                       int64_t seed, int64_t hadamard) {
  const int64_t length = check_quantize_rows(x, packed, bits, block);
  const int log2h = check_hadamard(hadamard, block);
  cpu_kernels().quantize_rows(x.data_ptr(), cpu_dtype(x), packed.data_ptr<uint8_t>(), packed.size(0), length,
                              static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), log2h, nullptr);
}

void reorder_quantize_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block, int64_t nodes,
                          int64_t node_size, int64_t stages, bool stochastic, int64_t seed, int64_t hadamard) {
  const int64_t length = check_reorder_quantize(x, packed, bits, block, nodes, node_size, stages);
  const int log2h = check_hadamard(hadamard, block);
  const RowReorder reorder{stages, node_size, nodes};
  cpu_kernels().quantize_rows(x.data_ptr(), cpu_dtype(x), packed.data_ptr<uint8_t>(), packed.size(0), length,
                              static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), log2h, &reorder);
}

void dequantize_rows_cpu(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block,
                         int64_t hadamard) {
  const int64_t length = check_dequantize_rows(packed, out, bits, block);
  const int log2h = check_hadamard(hadamard, block);
  cpu_kernels().dequantize_rows(packed.data_ptr<uint8_t>(), out.data_ptr(), cpu_dtype(out), packed.size(0), length,
                                static_cast<int>(bits), block, log2h, false);
}

void dequantize_add_rows_cpu(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block,
                             int64_t hadamard) {
  const int64_t length = check_dequantize_rows(packed, out, bits, block);
  const int log2h = check_hadamard(hadamard, block);
  cpu_kernels().dequantize_rows(packed.data_ptr<uint8_t>(), out.data_ptr(), cpu_dtype(out), packed.size(0), length,
                                static_cast<int>(bits), block, log2h, true);
}

void dequant_reduce_quantize_cpu(const at::Tensor& packed_in, const at::Tensor& packed_out, int64_t row_numel,
                                 int64_t bits_in, int64_t block_in, int64_t bits_out, int64_t block_out,
                                 bool stochastic, int64_t seed, int64_t hadamard_in, int64_t hadamard_out) {
  check_dequant_reduce_quantize(packed_in, packed_out, row_numel, bits_in, block_in, bits_out, block_out);
  const int log2h_in = check_hadamard_in_out(hadamard_in, block_in, block_out, "hadamard_in");
  const int log2h_out = check_hadamard(hadamard_out, block_out, "hadamard_out");
  cpu_kernels().dequant_reduce_quantize(packed_in.data_ptr<uint8_t>(), packed_out.data_ptr<uint8_t>(),
                                        packed_in.size(0), packed_in.size(1), row_numel, static_cast<int>(bits_in),
                                        block_in, static_cast<int>(bits_out), block_out, stochastic,
                                        static_cast<uint64_t>(seed), log2h_in, log2h_out);
}

void dequant_reduce_cpu(const at::Tensor& packed_in, const at::Tensor& out, int64_t bits, int64_t block,
                        double divisor, int64_t hadamard) {
  const int64_t length = check_dequant_reduce(packed_in, out, bits, block, divisor);
  const int log2h = check_hadamard(hadamard, block);
  cpu_kernels().dequant_reduce(packed_in.data_ptr<uint8_t>(), out.data_ptr(), cpu_dtype(out), packed_in.size(0),
                               packed_in.size(1), length, static_cast<int>(bits), block,
                               static_cast<float>(divisor), log2h);
}


// ------------------------------ the CUDA kernels' schedule, on the host ----
// Test-only ops (_cuda_schedule_*): the CUDA kernels' work decomposition run serially on CPU
// tensors with the same zpp/quant_chunks.h functions the device code calls: chunk loads and
// tails, lane -> chunk assignment of each group shape, staged or streamed passes, whole-word
// packing (row padding included), the per-chunk fused sum. What they cannot cover is the CUDA
// side proper: shuffles, vector loads, launch shapes. tests/test_kernels.py requires their bytes
// to equal the CPU kernels'.
void store_scale_bytes(uint8_t* row, int64_t k, float scale) { std::memcpy(row + 4 * k, &scale, 4); }

template <typename T>
struct HostInputSource {
  const T* xb;
  void load(int64_t c, int cnt, float (&v)[chunks::kChunk]) const {
    for (int i = 0; i < cnt; ++i) v[i] = static_cast<float>(xb[c * chunks::kChunk + i]);
  }
};

// The in-register rotation of a staged group (quant_kernels.cu group_rotate), the lanes in step:
// each stage reads the partner lane's values as they were before it (a shuffle's snapshot).
template <int V, typename Staged>
void schedule_group_rotate(std::vector<Staged>& staged, int64_t n, int lanes, int log2h) {
  if (log2h == 0) return;
  for (int st = 0; st < chunks::rotation_stages(log2h); ++st) {
    const std::vector<Staged> before = staged;
    for (int lane = 0; lane < lanes; ++lane)
      chunks::lane_rotation_stage<V>(staged[lane].v, n, lane, lanes, log2h, st, [&](int s, int i, int64_t dc) {
        return before[lane ^ static_cast<int>(dc)].v[s][i];
      });
  }
  for (int lane = 0; lane < lanes; ++lane) chunks::lane_rotation_scale<V>(staged[lane].v, n, lane, lanes, log2h);
}

// One quantization block by a group of `lanes` emulated threads; returns the block's scale.
// log2h_a, log2h_b: the rotations of the staged values (fused shapes only).
template <int V, typename Source>
float schedule_group(Source& src, int64_t n, int lanes, int bits, bool stochastic, uint64_t seed, uint64_t index0,
                     uint8_t* data, int64_t e0, int log2h_a = 0, int log2h_b = 0) {
  chunks::RowSink sink{data, e0, bits};
  uint32_t m = 0;
  TORCH_CHECK((log2h_a == 0 && log2h_b == 0) || (V > 0 && lanes <= chunks::kWarp),
              "megatron_zpp::_cuda_schedule_*: the CUDA kernels rotate in registers only for blocks of <= 2048 "
              "elements");
  if constexpr (V > 0) {
    struct Staged {
      float v[V][chunks::kChunk];
    };
    std::vector<Staged> staged(lanes);
    // Slots and elements a lane does not load hold garbage on a GPU: NaN here, so a rotation that read one
    // into a live value would change the bytes instead of adding a harmless 0.
    for (Staged& st : staged)
      std::fill(&st.v[0][0], &st.v[0][0] + V * chunks::kChunk, std::numeric_limits<float>::quiet_NaN());
    for (int lane = 0; lane < lanes; ++lane)
      m = std::max(m, chunks::lane_stage<V>(src, n, lane, lanes, staged[lane].v));
    if (log2h_a | log2h_b) {
      schedule_group_rotate<V>(staged, n, lanes, log2h_a);
      schedule_group_rotate<V>(staged, n, lanes, log2h_b);
      m = 0;
      for (int lane = 0; lane < lanes; ++lane)
        m = std::max(m, chunks::lane_staged_absmax<V>(staged[lane].v, n, lane, lanes));
    }
    const chunks::BlockQuant q = chunks::block_quant(m, bits, stochastic, seed);
    for (int lane = 0; lane < lanes; ++lane)
      chunks::lane_quantize<V>(sink, staged[lane].v, n, lane, lanes, bits, q, index0);
    return q.scale;
  } else {
    for (int lane = 0; lane < lanes; ++lane) m = std::max(m, chunks::lane_absmax_streamed(src, n, lane, lanes));
    const chunks::BlockQuant q = chunks::block_quant(m, bits, stochastic, seed);
    for (int lane = 0; lane < lanes; ++lane) chunks::lane_quantize_streamed(src, sink, n, lane, lanes, bits, q, index0);
    return q.scale;
  }
}

template <typename Fn>
void schedule_dispatch(int64_t block, Fn fn) {
  const chunks::GroupShape shape = chunks::group_shape(block);
  switch (shape.chunks_per_lane) {
    case 1: return fn(std::integral_constant<int, 1>{}, shape.lanes);
    case 2: return fn(std::integral_constant<int, 2>{}, shape.lanes);
    case 4: return fn(std::integral_constant<int, 4>{}, shape.lanes);
    case 8: return fn(std::integral_constant<int, 8>{}, shape.lanes);
    default: return fn(std::integral_constant<int, 0>{}, shape.lanes);
  }
}

template <typename Fn>
void schedule_dtype(const at::Tensor& t, Fn fn) {
  switch (t.scalar_type()) {
    case at::kFloat: return fn(static_cast<float*>(nullptr));
    case at::kBFloat16: return fn(static_cast<c10::BFloat16*>(nullptr));
    default: return fn(static_cast<c10::Half*>(nullptr));
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "megatron_zpp::_cuda_schedule_*: ", name, " must be a CPU tensor (host emulation)");
}

void cuda_schedule_quantize_rows(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block,
                                 bool stochastic, int64_t seed, int64_t hadamard) {
  const int64_t length = check_quantize_rows(x, packed, bits, block);
  const int log2h = check_hadamard(hadamard, block);
  check_cpu(x, "x");
  const int64_t rows = packed.size(0), nb = num_blocks(length, block), rb = row_bytes(length, bits, block);
  uint8_t* out = packed.data_ptr<uint8_t>();
  schedule_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xt = static_cast<const T*>(x.data_ptr());
    schedule_dispatch(block, [&](auto v, int lanes) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < nb; ++k) {
          const int64_t e0 = k * block, n = std::min(block, length - e0);
          HostInputSource<T> src{xt + r * length + e0};
          uint8_t* row = out + r * rb;
          store_scale_bytes(row, k, schedule_group<decltype(v)::value>(src, n, lanes, static_cast<int>(bits),
                                                                        stochastic, static_cast<uint64_t>(seed),
                                                                        static_cast<uint64_t>(r * length + e0),
                                                                        row + 4 * nb, e0, log2h));
        }
    });
  });
}

void cuda_schedule_dequant_reduce_quantize(const at::Tensor& packed_in, const at::Tensor& packed_out,
                                           int64_t row_numel, int64_t bits_in, int64_t block_in, int64_t bits_out,
                                           int64_t block_out, bool stochastic, int64_t seed, int64_t hadamard_in,
                                           int64_t hadamard_out) {
  check_dequant_reduce_quantize(packed_in, packed_out, row_numel, bits_in, block_in, bits_out, block_out);
  const int log2h_in = check_hadamard_in_out(hadamard_in, block_in, block_out, "hadamard_in");
  const int log2h_out = check_hadamard(hadamard_out, block_out, "hadamard_out");
  const bool same = log2h_in == log2h_out;  // the sum stays in the rotated domain: no rotation
  check_cpu(packed_in, "packed_in");
  const int64_t chunks = packed_in.size(0), rows = packed_in.size(1);
  const int64_t nb_in = num_blocks(row_numel, block_in), rb_in = row_bytes(row_numel, static_cast<int>(bits_in), block_in);
  const int64_t nb = num_blocks(row_numel, block_out), rb = row_bytes(row_numel, static_cast<int>(bits_out), block_out);
  uint8_t* out = packed_out.data_ptr<uint8_t>();
  schedule_dispatch(block_out, [&](auto v, int lanes) {
    for (int64_t k = 0; k < rows; ++k)
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t e0 = j * block_out, n = std::min(block_out, row_numel - e0);
        chunks::ReduceSource src{packed_in.data_ptr<uint8_t>(), chunks, rows, rb_in, nb_in, k, e0,
                                 static_cast<int>(bits_in), block_in};
        uint8_t* row = out + k * rb;
        store_scale_bytes(row, j, schedule_group<decltype(v)::value>(src, n, lanes, static_cast<int>(bits_out),
                                                                      stochastic, static_cast<uint64_t>(seed),
                                                                      static_cast<uint64_t>(k * row_numel + e0),
                                                                      row + 4 * nb, e0, same ? 0 : log2h_in,
                                                                      same ? 0 : log2h_out));
      }
  });
}

// The rotated elementwise kernels (quant_kernels.cu *_rotated_kernel) on emulated threads: thread t
// of the padded map (rows padded to whole runs, the total to whole warps) holds chunk
// t % per_row of row t / per_row; fill(r, e, cnt, v) decodes (or reduces) a chunk, finish(r, e, cnt, v)
// stores it. A cross-chunk stage reads the value of thread t ^ dc, which must be in the same warp
// and hold chunk c ^ dc of the same row (checked: that is what padding to whole runs guarantees).
template <typename Fill, typename Finish>
void schedule_rotated_chunks(int64_t rows, int64_t length, int log2h, Fill fill, Finish finish) {
  TORCH_CHECK(chunks::chunk_rotation_fused(log2h), "megatron_zpp::_cuda_schedule_*: the CUDA kernels rotate in "
              "registers only for runs of <= 256");
  using Chunk = std::array<float, chunks::kChunk>;
  const int64_t per_row = chunks::padded_row_chunks(length, log2h);
  const int64_t threads = ceil_div(rows * per_row, chunks::kWarp) * chunks::kWarp;
  std::vector<Chunk> v(threads, Chunk{});
  std::vector<int> cnt(threads, 0);
  auto where = [&](int64_t t) { return std::pair<int64_t, int64_t>{t / per_row, t % per_row}; };
  for (int64_t t = 0; t < threads; ++t) {
    const auto [r, c] = where(t);
    cnt[t] = t < rows * per_row ? chunks::chunk_count(length - c * chunks::kChunk, 0) : 0;
    if (cnt[t] > 0) {
      float f[chunks::kChunk] = {};
      fill(r, c * chunks::kChunk, cnt[t], f);
      std::copy(f, f + chunks::kChunk, v[t].begin());
    }
  }
  auto as_array = [](Chunk& a) -> float (&)[chunks::kChunk] { return *reinterpret_cast<float(*)[chunks::kChunk]>(a.data()); };
  for (int64_t t = 0; t < threads; ++t) chunks::chunk_stages(as_array(v[t]), where(t).second * chunks::kChunk, length, log2h);
  for (int64_t dc = 1; dc < chunks::run_chunks(log2h); dc <<= 1) {
    const std::vector<Chunk> before = v;
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t p = t ^ dc;  // __shfl_xor_sync(lane ^ dc)
      TORCH_CHECK(p / chunks::kWarp == t / chunks::kWarp, "schedule: shuffle partner outside the warp");
      const auto [r, c] = where(t);
      if (t < rows * per_row && cnt[t] > 0)
        TORCH_CHECK(where(p) == std::make_pair(r, c ^ dc), "schedule: shuffle partner of row ", r, " chunk ", c,
                    " is not chunk ", (c ^ dc));
      for (int i = 0; i < chunks::kChunk; ++i)
        v[t][i] = chunks::cross_chunk_value(before[t][i], before[p][i], c, length, dc, log2h);
    }
  }
  for (int64_t t = 0; t < threads; ++t) {
    chunks::chunk_run_scale(as_array(v[t]), where(t).second * chunks::kChunk, length, log2h);
    if (cnt[t] > 0) finish(where(t).first, where(t).second * chunks::kChunk, cnt[t], as_array(v[t]));
  }
}

// The elementwise kernels: one emulated thread per chunk.
void cuda_schedule_dequantize_rows(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block,
                                   int64_t hadamard, bool accumulate) {
  const int64_t length = check_dequantize_rows(packed, out, bits, block);
  const int log2h = check_hadamard(hadamard, block);
  check_cpu(packed, "packed");
  const int64_t rows = packed.size(0), nb = num_blocks(length, block), rb = row_bytes(length, bits, block);
  const uint8_t* in = packed.data_ptr<uint8_t>();
  schedule_dtype(out, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* y = static_cast<T*>(out.data_ptr());
    if (log2h) {
      schedule_rotated_chunks(rows, length, log2h,
          [&](int64_t r, int64_t e, int cnt, float (&v)[chunks::kChunk]) {
            const uint8_t* row = in + r * rb;
            uint32_t w[2];
            chunks::load_chunk_words(row + 4 * nb, e, cnt, static_cast<int>(bits), w);
            chunks::dequantize_chunk(w, static_cast<int>(bits), chunks::load_f32_scale(row, e / block), v);
          },
          [&](int64_t r, int64_t e, int cnt, const float (&v)[chunks::kChunk]) {
            for (int i = 0; i < cnt; ++i) {  // accumulate: cast(rotated decoded + fp32(out)), one rounding
              T& o = y[r * length + e + i];
              o = static_cast<T>(accumulate ? f32_add(v[i], static_cast<float>(o)) : v[i]);
            }
          });
      return;
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < length; e += chunks::kChunk) {
        const int cnt = chunks::chunk_count(length - e, 0);
        const uint8_t* row = in + r * rb;
        uint32_t w[2];
        chunks::load_chunk_words(row + 4 * nb, e, cnt, static_cast<int>(bits), w);
        float v[chunks::kChunk];
        chunks::dequantize_chunk(w, static_cast<int>(bits), chunks::load_f32_scale(row, e / block), v);
        for (int i = 0; i < cnt; ++i) {
          T& o = y[r * length + e + i];
          o = static_cast<T>(accumulate ? f32_add(v[i], static_cast<float>(o)) : v[i]);
        }
      }
  });
}

void cuda_schedule_dequant_reduce(const at::Tensor& packed_in, const at::Tensor& out, int64_t bits, int64_t block,
                                  double divisor, int64_t hadamard) {
  const int64_t length = check_dequant_reduce(packed_in, out, bits, block, divisor);
  const int log2h = check_hadamard(hadamard, block);
  check_cpu(packed_in, "packed_in");
  const int64_t chunks = packed_in.size(0), rows = packed_in.size(1);
  const int64_t nb = num_blocks(length, block), rb = row_bytes(length, static_cast<int>(bits), block);
  const float d = static_cast<float>(divisor);
  schedule_dtype(out, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* y = static_cast<T*>(out.data_ptr());
    if (log2h) {
      schedule_rotated_chunks(rows, length, log2h,
          [&](int64_t k, int64_t e, int cnt, float (&acc)[chunks::kChunk]) {
            chunks::reduce_chunk(packed_in.data_ptr<uint8_t>(), chunks, rows, rb, nb, k, e, cnt,
                                 static_cast<int>(bits), block, acc);
          },
          [&](int64_t k, int64_t e, int cnt, const float (&acc)[chunks::kChunk]) {
            for (int i = 0; i < cnt; ++i) y[k * length + e + i] = static_cast<T>(f32_div(acc[i], d));
          });
      return;
    }
    for (int64_t k = 0; k < rows; ++k)
      for (int64_t e = 0; e < length; e += chunks::kChunk) {
        const int cnt = chunks::chunk_count(length - e, 0);
        float acc[chunks::kChunk];
        chunks::reduce_chunk(packed_in.data_ptr<uint8_t>(), chunks, rows, rb, nb, k, e, cnt, static_cast<int>(bits),
                             block, acc);
        for (int i = 0; i < cnt; ++i) y[k * length + e + i] = static_cast<T>(f32_div(acc[i], d));
      }
  });
}

// [lanes, chunks_per_lane] of the CUDA quantizing kernels for a block size.
std::vector<int64_t> cuda_group_shape(int64_t block) {
  check_bits_block(8, block);
  const chunks::GroupShape s = chunks::group_shape(block);
  return {s.lanes, s.chunks_per_lane};
}

}  // namespace

// The level in use, for the other kernel families (zfp_cpu.cpp), so ZPP_CPU_ISA and _set_cpu_isa
// choose one level for every CPU kernel.
std::string active_cpu_isa() { return cpu_isa(); }

}  // namespace zpp

TORCH_LIBRARY_IMPL(megatron_zpp, CPU, m) {
  m.impl("quantize_rows_", &zpp::quantize_rows_cpu);
  m.impl("reorder_quantize_", &zpp::reorder_quantize_cpu);
  m.impl("dequantize_rows_", &zpp::dequantize_rows_cpu);
  m.impl("dequantize_add_rows_", &zpp::dequantize_add_rows_cpu);
  m.impl("dequant_reduce_quantize_", &zpp::dequant_reduce_quantize_cpu);
  m.impl("dequant_reduce_", &zpp::dequant_reduce_cpu);
  m.impl("_cuda_schedule_quantize_rows_", &zpp::cuda_schedule_quantize_rows);
  m.impl("_cuda_schedule_dequantize_rows_", &zpp::cuda_schedule_dequantize_rows);
  m.impl("_cuda_schedule_dequant_reduce_quantize_", &zpp::cuda_schedule_dequant_reduce_quantize);
  m.impl("_cuda_schedule_dequant_reduce_", &zpp::cuda_schedule_dequant_reduce);
}

// Which compiled level of the CPU loops runs (no tensors: registered with their implementation).
TORCH_LIBRARY_FRAGMENT(megatron_zpp, m) {
  m.def("_cpu_isa() -> str", &zpp::cpu_isa);
  m.def("_cpu_isas() -> str[]", &zpp::cpu_isas);
  m.def("_set_cpu_isa(str isa) -> str", &zpp::set_cpu_isa);
  // Test-only: the CUDA kernels' work decomposition (zpp/quant_chunks.h) run on CPU tensors.
  m.def("_cuda_group_shape(int block) -> int[]", &zpp::cuda_group_shape);
  m.def(
      "_cuda_schedule_quantize_rows_(Tensor x, Tensor(a!) packed, int bits, int block, bool stochastic, int seed, "
      "int hadamard=0) -> ()");
  m.def(
      "_cuda_schedule_dequantize_rows_(Tensor packed, Tensor(a!) out, int bits, int block, int hadamard=0, "
      "bool accumulate=False) -> ()");
  m.def(
      "_cuda_schedule_dequant_reduce_quantize_(Tensor packed_in, Tensor(a!) packed_out, int row_numel, int bits_in, "
      "int block_in, int bits_out, int block_out, bool stochastic, int seed, int hadamard_in=0, "
      "int hadamard_out=0) -> ()");
  m.def(
      "_cuda_schedule_dequant_reduce_(Tensor packed_in, Tensor(a!) out, int bits, int block, float divisor, "
      "int hadamard=0) -> ()");
}
