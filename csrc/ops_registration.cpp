// Schemas of the torch.ops.megatron_zpp ops. Implementations: cpu/quant_cpu.cpp
// (CPU) and cuda/quant_cuda_binding.cpp (CUDA); contract and reference:
// megatron_zpp/compression/ops.py and reference.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(megatron_zpp, m) {
  m.def("quantize_rows_(Tensor x, Tensor(a!) packed, int bits, int block, bool stochastic, int seed) -> ()");
  m.def(
      "reorder_quantize_(Tensor x, Tensor(a!) packed, int bits, int block, int nodes, int node_size, "
      "int stages, bool stochastic, int seed) -> ()");
  m.def("dequantize_rows_(Tensor packed, Tensor(a!) out, int bits, int block) -> ()");
  m.def(
      "dequant_reduce_quantize_(Tensor packed_in, Tensor(a!) packed_out, int row_numel, int bits_in, "
      "int block_in, int bits_out, int block_out, bool stochastic, int seed) -> ()");
  m.def("dequant_reduce_(Tensor packed_in, Tensor(a!) out, int bits, int block, float divisor) -> ()");
}

// `import megatron_zpp._C` loads this library, which registers the ops above;
// the module itself has no Python attributes.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
