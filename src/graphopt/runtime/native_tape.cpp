// A host graph's tape replayed from C++: one boxed dispatcher call per op, no
// Python between ops. Built by native_tape.py (torch's JIT C++ extension loader).
//
// Each entry is an ATen overload with the argument stack recorded at capture: the
// same tensor objects (so their moves into the pool arena are seen), the same
// numbers. An op without an out= overload ("recompute") has its returns copied into
// the tensors it returned at capture. What only Python can replay (a collective and
// its wait) is a Python callable entry.
//
// createStackForSchema is torch's own Python -> IValue conversion for torch.ops calls
// (torch/csrc/jit/python/pybind_utils.h), the one private torch API this file uses.

// torch/python.h, not torch/extension.h: the C++ frontend that adds is not used here and
// is a third of the compile time.
#include <ATen/ATen.h>
#include <torch/python.h>

#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace {

struct Entry {
  std::optional<c10::OperatorHandle> op;  // empty: `python` replays the entry
  torch::jit::Stack stack;
  bool recompute = false;
  std::vector<std::optional<at::Tensor>> targets;  // recompute: where each return goes
  py::object python;
};

class Tape {
 public:
  void call(const std::string& name, const std::string& overload, const py::tuple& args, const py::dict& kwargs) {
    entries_.push_back(entry(name, overload, args, kwargs));
  }

  void recompute(const std::string& name, const std::string& overload, const py::tuple& args, const py::dict& kwargs,
                 std::vector<std::optional<at::Tensor>> targets) {
    Entry e = entry(name, overload, args, kwargs);
    if (targets.size() != e.op->schema().returns().size()) {
      throw std::invalid_argument("recompute: one target per return of " + name + "." + overload);
    }
    e.recompute = true;
    e.targets = std::move(targets);
    entries_.push_back(std::move(e));
  }

  void python(py::object fn) {
    Entry e;
    e.python = std::move(fn);
    entries_.push_back(std::move(e));
  }

  size_t size() const { return entries_.size(); }

  void replay() const {
    c10::InferenceMode inference;  // a host graph records no autograd history
    for (const Entry& e : entries_) {
      if (!e.op) {
        e.python();
        continue;
      }
      torch::jit::Stack stack = e.stack;  // callBoxed consumes its arguments
      e.op->callBoxed(stack);
      if (e.recompute) {
        for (size_t i = 0; i < e.targets.size(); ++i) {
          if (e.targets[i]) {
            e.targets[i]->copy_(stack[i].toTensor());
          }
        }
      }
    }
  }

 private:
  static Entry entry(const std::string& name, const std::string& overload, const py::tuple& args,
                     const py::dict& kwargs) {
    Entry e;
    e.op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const c10::FunctionSchema& schema = e.op->schema();
    py::tuple wrapped_args(args.size());
    for (size_t i = 0; i < args.size(); ++i) {
      wrapped_args[i] = i < schema.arguments().size() ? wrap_number(schema.arguments()[i], args[i]) : args[i];
    }
    py::kwargs wrapped_kwargs;
    for (const auto& item : kwargs) {
      auto index = schema.argumentIndexWithName(py::cast<std::string>(item.first));
      wrapped_kwargs[item.first] = index ? wrap_number(schema.arguments()[*index], item.second)
                                         : py::reinterpret_borrow<py::object>(item.second);
    }
    e.stack = torch::jit::createStackForSchema(schema, wrapped_args, wrapped_kwargs, std::nullopt);
    return e;
  }

  // A number recorded for a Tensor argument (`x + 1e-6` reaches Python dispatch as
  // add.Tensor(x, 1e-6)) becomes the wrapped-number tensor torch's argument parser
  // makes of it, so type promotion treats it as a number still.
  static py::object wrap_number(const c10::Argument& argument, py::handle value) {
    bool number = PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr()) || PyComplex_Check(value.ptr());
    if (!number || argument.type()->kind() != c10::TypeKind::TensorType) {
      return py::reinterpret_borrow<py::object>(value);
    }
    at::Tensor tensor = c10::scalar_to_tensor(torch::jit::toIValue(value, c10::NumberType::get()).toScalar());
    tensor.unsafeGetTensorImpl()->set_wrapped_number(true);
    return py::cast(tensor);
  }

  std::vector<Entry> entries_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Tape>(m, "Tape")
      .def(py::init<>())
      .def("call", &Tape::call)
      .def("recompute", &Tape::recompute)
      .def("python", &Tape::python)
      .def("__len__", &Tape::size)
      .def("replay", &Tape::replay);
}
