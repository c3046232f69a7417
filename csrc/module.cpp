// The op schemas (declared once, for every backend) and the Python module ampinit._C.
//
// The implementations register themselves: cpu/ops_cpu.cpp for CPU, cuda/ops_cuda.cu for CUDA.
// Python calls the ops through torch.ops.ampinit.*; the module itself only reports what was
// built.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <exception>
#include <string>

#ifdef AMPINIT_WITH_CUDA
#include "cuda/launch_config.h"
#endif

namespace ampinit::cpu {
std::string kernel_name();
}

TORCH_LIBRARY(ampinit, m) {
  m.def("unscale_(Tensor[] inputs, Tensor(a!)[] outputs, Tensor inv_scale, Tensor(b!) found_inf, "
        "Tensor(c!)? per_tensor_found_inf=None) -> ()");
  m.def("accumulate_(Tensor[] inputs, Tensor(a!)[] outputs, Tensor inv_scale, Tensor(b!) found_inf, "
        "float out_weight=1.0) -> ()");
  m.def("copy_(Tensor(a!)[] outputs, Tensor[] inputs) -> ()");
  m.def("adopt_changes_(Tensor(a!)[] masters, Tensor[] models, Tensor? only=None) -> ()");
  m.def("fingerprint(Tensor[] inputs) -> Tensor");
  m.def("check_finite_(Tensor[] inputs, Tensor(a!) found_inf, Tensor(b!)? per_tensor_found_inf=None) -> ()");
  m.def("l2norm(Tensor[] inputs, bool per_tensor=False) -> (Tensor, Tensor)");
  m.def("update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
        "Tensor(d!) overflow_count, Tensor found_inf, float growth_factor, float backoff_factor, "
        "int growth_interval, int hysteresis, float min_scale, float max_scale) -> ()");
  m.def("fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] steps, Tensor(e!)[] model_params, Tensor(f!)[] remainders, Tensor(g!)[] ties, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, bool decoupled_weight_decay, bool bias_correction, Tensor inv_scale, "
        "Tensor found_inf, Tensor? hyper=None, bool stochastic_state_rounding=False) -> ()");
  m.def("fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] steps, "
        "Tensor(d!)[] model_params, Tensor(f!)[] remainders, Tensor(g!)[] ties, float lr, float momentum, float dampening, float weight_decay, "
        "bool nesterov, Tensor inv_scale, Tensor found_inf, Tensor(e!)[] new_buffer_flags, "
        "Tensor? hyper=None) -> ()");
  m.def("join_masters(Tensor[] weights, Tensor[] remainders, Tensor[] ties) -> Tensor[]");
  m.def("split_masters_(Tensor(a!)[] weights, Tensor(b!)[] remainders, Tensor(c!)[] ties, Tensor[] masters) -> ()");
}

namespace {

PyObject* cpu_kernels(PyObject*, PyObject*) {
  return PyUnicode_FromString(ampinit::cpu::kernel_name().c_str());
}

// What the tensors of some sequences are, in one C pass (a Python loop over 1000 gradients
// costs more than the launches it decides): bit 1 = all are dense float32/float16/bfloat16
// (the kernels take them), bit 2 = some are complex.
PyObject* tensor_kinds(PyObject*, PyObject* args) {
  bool kernels = true, complex = false;
  const Py_ssize_t count = PyTuple_GET_SIZE(args);
  for (Py_ssize_t a = 0; a < count; ++a) {
    PyObject* sequence = PySequence_Fast(PyTuple_GET_ITEM(args, a), "ampinit: expected sequences of tensors");
    if (sequence == nullptr) return nullptr;
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(sequence);
    PyObject** items = PySequence_Fast_ITEMS(sequence);
    for (Py_ssize_t i = 0; i < size; ++i) {
      if (!THPVariable_Check(items[i])) {
        Py_DECREF(sequence);
        PyErr_Format(PyExc_TypeError, "ampinit: expected tensors; got %s", Py_TYPE(items[i])->tp_name);
        return nullptr;
      }
      const at::Tensor& tensor = THPVariable_Unpack(items[i]);
      const auto type = tensor.scalar_type();
      kernels = kernels && tensor.layout() == at::kStrided &&
                (type == at::kFloat || type == at::kHalf || type == at::kBFloat16);
      complex = complex || at::isComplexType(type);
    }
    Py_DECREF(sequence);
  }
  return PyLong_FromLong((kernels ? 1 : 0) | (complex ? 2 : 0));
}

#ifdef AMPINIT_WITH_CUDA
// The CUDA launches' kernel-parameter space (4096 or 32764 bytes), and a switch for tests and
// benchmarks of both paths.  Errors become Python exceptions.
PyObject* cuda_kernel_param_bytes(PyObject*, PyObject*) {
  try {
    return PyLong_FromLong(ampinit::cuda::kernel_param_bytes());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
}

PyObject* set_cuda_kernel_param_bytes(PyObject*, PyObject* arg) {
  const long bytes = PyLong_AsLong(arg);
  if (bytes == -1 && PyErr_Occurred()) return nullptr;
  try {
    ampinit::cuda::set_kernel_param_bytes(static_cast<int>(bytes));
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}
#endif

PyMethodDef methods[] = {
    {"cpu_kernels", cpu_kernels, METH_NOARGS, "Which CPU kernels run here: 'avx2' or 'default'."},
    {"tensor_kinds", tensor_kinds, METH_VARARGS,
     "tensor_kinds(*sequences) -> int: 1 if all tensors are dense float32/float16/bfloat16, | 2 if any is complex."},
#ifdef AMPINIT_WITH_CUDA
    {"cuda_kernel_param_bytes", cuda_kernel_param_bytes, METH_NOARGS,
     "Bytes of kernel parameters the CUDA launches use: 32764 (CUDA >= 12.1 build and driver, Volta+) or 4096."},
    {"_set_cuda_kernel_param_bytes", set_cuda_kernel_param_bytes, METH_O,
     "Force 4096 or 32764 bytes of CUDA kernel parameters (0: automatic). For tests and benchmarks."},
#endif
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
