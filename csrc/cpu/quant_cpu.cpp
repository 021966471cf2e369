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
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "zpp/op_checks.h"
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
#include "quant_cpu_isa.h"
#undef ZPP_CPU_ISA_NS
#undef ZPP_CPU_ISA_F16C

#if ZPP_CPU_X86_LEVELS
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define ZPP_CPU_ISA_NS isa_x86_64_v3
#define ZPP_CPU_ISA_F16C 1
#include "quant_cpu_isa.h"
#undef ZPP_CPU_ISA_NS
#undef ZPP_CPU_ISA_F16C
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define ZPP_CPU_ISA_NS isa_x86_64_v4
#define ZPP_CPU_ISA_F16C 1
#include "quant_cpu_isa.h"
#undef ZPP_CPU_ISA_NS
#undef ZPP_CPU_ISA_F16C
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
                       int64_t seed) {
  const int64_t length = check_quantize_rows(x, packed, bits, block);
  cpu_kernels().quantize_rows(x.data_ptr(), cpu_dtype(x), packed.data_ptr<uint8_t>(), packed.size(0), length,
                              static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), nullptr);
}

void reorder_quantize_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block, int64_t nodes,
                          int64_t node_size, int64_t stages, bool stochastic, int64_t seed) {
  const int64_t length = check_reorder_quantize(x, packed, bits, block, nodes, node_size, stages);
  const RowReorder reorder{stages, node_size, nodes};
  cpu_kernels().quantize_rows(x.data_ptr(), cpu_dtype(x), packed.data_ptr<uint8_t>(), packed.size(0), length,
                              static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), &reorder);
}

void dequantize_rows_cpu(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block) {
  const int64_t length = check_dequantize_rows(packed, out, bits, block);
  cpu_kernels().dequantize_rows(packed.data_ptr<uint8_t>(), out.data_ptr(), cpu_dtype(out), packed.size(0), length,
                                static_cast<int>(bits), block);
}

void dequant_reduce_quantize_cpu(const at::Tensor& packed_in, const at::Tensor& packed_out, int64_t row_numel,
                                 int64_t bits_in, int64_t block_in, int64_t bits_out, int64_t block_out,
                                 bool stochastic, int64_t seed) {
  check_dequant_reduce_quantize(packed_in, packed_out, row_numel, bits_in, block_in, bits_out, block_out);
  cpu_kernels().dequant_reduce_quantize(packed_in.data_ptr<uint8_t>(), packed_out.data_ptr<uint8_t>(),
                                        packed_in.size(0), packed_in.size(1), row_numel, static_cast<int>(bits_in),
                                        block_in, static_cast<int>(bits_out), block_out, stochastic,
                                        static_cast<uint64_t>(seed));
}

void dequant_reduce_cpu(const at::Tensor& packed_in, const at::Tensor& out, int64_t bits, int64_t block,
                        double divisor) {
  const int64_t length = check_dequant_reduce(packed_in, out, bits, block, divisor);
  cpu_kernels().dequant_reduce(packed_in.data_ptr<uint8_t>(), out.data_ptr(), cpu_dtype(out), packed_in.size(0),
                               packed_in.size(1), length, static_cast<int>(bits), block,
                               static_cast<float>(divisor));
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
  m.impl("dequant_reduce_quantize_", &zpp::dequant_reduce_quantize_cpu);
  m.impl("dequant_reduce_", &zpp::dequant_reduce_cpu);
}

// Which compiled level of the CPU loops runs (no tensors: registered with their implementation).
TORCH_LIBRARY_FRAGMENT(megatron_zpp, m) {
  m.def("_cpu_isa() -> str", &zpp::cpu_isa);
  m.def("_cpu_isas() -> str[]", &zpp::cpu_isas);
  m.def("_set_cpu_isa(str isa) -> str", &zpp::set_cpu_isa);
}
