// MutedHooks and has_post_hooks: see muted_hooks.h.
#include "muted_hooks.h"

#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>

#include <string>

namespace mpstream {

namespace detail {

std::pair<std::shared_ptr<void>, torch::autograd::Node*> node_of(const pybind11::handle& node,
                                                                 const char* who) {
  PyObject* obj = node.ptr();
  std::pair<std::shared_ptr<void>, torch::autograd::Node*> held;
  if (torch::autograd::THPCppFunction_Check(obj)) {
    held = hold(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata);
  } else if (THPFunction_Check(obj)) {
    held = hold(reinterpret_cast<THPFunction*>(obj)->cdata);
  } else {
    throw pybind11::type_error(std::string(who) +
                               " takes an autograd node (a tensor's grad_fn, or a "
                               "GradientEdge's node), not " +
                               Py_TYPE(obj)->tp_name);
  }
  if (held.second == nullptr) {
    throw pybind11::value_error(std::string(who) +
                                ": this autograd node was freed (its graph was released)");
  }
  return held;
}

}  // namespace detail

MutedHooks::MutedHooks(const pybind11::handle& node) {
  auto held = detail::node_of(node, "MutedHooks");
  owner_ = std::move(held.first);
  node_ = held.second;
  std::swap(tensor_pre_, node_->tensor_pre_hooks());
  std::swap(pre_, node_->pre_hooks());
  std::swap(post_, node_->post_hooks());
}

MutedHooks::~MutedHooks() { restore(); }

void MutedHooks::restore() {
  if (node_ == nullptr) {
    return;
  }
  detail::give_back(tensor_pre_, node_->tensor_pre_hooks());
  detail::give_back(pre_, node_->pre_hooks());
  detail::give_back(post_, node_->post_hooks());
  node_ = nullptr;
  owner_.reset();  // may free the node, and with it the graph below
}

bool has_post_hooks(const pybind11::handle& node) {
  auto held = detail::node_of(node, "has_post_hooks");
  return !held.second->post_hooks().empty();
}

}  // namespace mpstream
