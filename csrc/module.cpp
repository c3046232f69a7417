// The op schemas (declared once, for every backend) and the Python module ampinit._C.
//
// The implementations register themselves: cpu/ops_cpu.cpp for CPU, cuda/ops_cuda.cu for CUDA.
// Python calls the ops through torch.ops.ampinit.*; the module itself only reports what was
// built.
#include <Python.h>
#include <torch/library.h>

#include <string>

namespace ampinit::cpu {
std::string kernel_name();
}

TORCH_LIBRARY(ampinit, m) {
  m.def("unscale_(Tensor[] inputs, Tensor(a!)[] outputs, Tensor inv_scale, Tensor(b!) found_inf, "
        "Tensor(c!)? per_tensor_found_inf=None) -> ()");
  m.def("accumulate_(Tensor[] inputs, Tensor(a!)[] outputs, Tensor inv_scale, Tensor(b!) found_inf, "
        "float out_weight=1.0) -> ()");
  m.def("copy_(Tensor(a!)[] outputs, Tensor[] inputs) -> ()");
  m.def("check_finite_(Tensor[] inputs, Tensor(a!) found_inf, Tensor(b!)? per_tensor_found_inf=None) -> ()");
  m.def("l2norm(Tensor[] inputs, bool per_tensor=False) -> (Tensor, Tensor)");
  m.def("update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
        "Tensor(d!) overflow_count, Tensor found_inf, float growth_factor, float backoff_factor, "
        "int growth_interval, int hysteresis, float min_scale, float max_scale) -> ()");
  m.def("fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] steps, Tensor(e!)[] model_params, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, bool decoupled_weight_decay, bool bias_correction, Tensor inv_scale, "
        "Tensor found_inf, Tensor? hyper=None) -> ()");
  m.def("fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] steps, "
        "Tensor(d!)[] model_params, float lr, float momentum, float dampening, float weight_decay, "
        "bool nesterov, Tensor inv_scale, Tensor found_inf, Tensor(e!)[] new_buffer_flags, "
        "Tensor? hyper=None) -> ()");
}

namespace {

PyObject* cpu_kernels(PyObject*, PyObject*) {
  return PyUnicode_FromString(ampinit::cpu::kernel_name().c_str());
}

PyMethodDef methods[] = {
    {"cpu_kernels", cpu_kernels, METH_NOARGS, "Which CPU kernels run here: 'avx2' or 'default'."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "ampinit's compiled kernels (see torch.ops.ampinit).",
                          -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#ifdef AMPINIT_WITH_CUDA
  PyModule_AddObject(module, "with_cuda", Py_NewRef(Py_True));
#else
  PyModule_AddObject(module, "with_cuda", Py_NewRef(Py_False));
#endif
  return module;
}
