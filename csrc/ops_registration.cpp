// Schemas of the torch.ops.megatron_zpp ops. Implementations: cpu/quant_cpu.cpp
// (CPU) and cuda/quant_cuda_binding.cpp (CUDA); contract and reference:
// megatron_zpp/compression/ops.py and reference.py. The lossless MPC ops: cpu/mpc_cpu.cpp,
// cuda/mpc_cuda_binding.cpp; reference mpc_reference.py, format lossless.md.
// ZFP: cpu/zfp_cpu.cpp and cuda/zfp_cuda_binding.cpp; contract megatron_zpp/compression/zfp.py, reference zfpy.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(megatron_zpp, m) {
  // hadamard: 0 (off) or the run length of the Walsh-Hadamard smoothing (blockwise.md), applied to the fp32
  // values before quantizing and to the fp32 decode (or sum) after.
  m.def(
      "quantize_rows_(Tensor x, Tensor(a!) packed, int bits, int block, bool stochastic, int seed, "
      "int hadamard=0) -> ()");
  m.def(
      "reorder_quantize_(Tensor x, Tensor(a!) packed, int bits, int block, int nodes, int node_size, "
      "int stages, bool stochastic, int seed, int hadamard=0) -> ()");
  m.def("dequantize_rows_(Tensor packed, Tensor(a!) out, int bits, int block, int hadamard=0) -> ()");
  // out = cast(decoded + fp32(out)): qWD adds the decoded weight differences to the weights it holds.
  m.def("dequantize_add_rows_(Tensor packed, Tensor(a!) out, int bits, int block, int hadamard=0) -> ()");
  m.def(
      "dequant_reduce_quantize_(Tensor packed_in, Tensor(a!) packed_out, int row_numel, int bits_in, "
      "int block_in, int bits_out, int block_out, bool stochastic, int seed, int hadamard_in=0, "
      "int hadamard_out=0) -> ()");
  m.def(
      "dequant_reduce_(Tensor packed_in, Tensor(a!) out, int bits, int block, float divisor, "
      "int hadamard=0) -> ()");
  // Lossless MPC: the whole container payload (on CUDA a worst-case-sized buffer, true length in its header).
  m.def("mpc_encode(Tensor x, int dim) -> Tensor");
  m.def("mpc_decode_(Tensor payload, Tensor(a!) out, int dim) -> ()");
  // ZPP-sum32 of a container payload, as an int64 0-d tensor on the payload's device.
  m.def("container_checksum(Tensor payload) -> Tensor");
  m.def("zfp_encode_(Tensor x, Tensor(a!) payload, int dims, int maxbits) -> ()");
  m.def("zfp_decode_(Tensor payload, Tensor(a!) out, int dims, int maxbits) -> ()");
}

// `import megatron_zpp._C` loads this library, which registers the ops above;
// the module itself has no Python attributes.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
