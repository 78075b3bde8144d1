// A copy between two GPUs in PyTorch runs on the sending device's stream
// and fences both devices' current streams with events of its own. Inside
// a capture per device that cannot work: the fence's events would join two
// captures, and the copy would land on a stream that is not capturing. A
// view of the sender's memory on the receiving device turns the copy into
// an ordinary one on the receiver's stream (`dst.copy_(view)`), which its
// capture holds; the caller orders it after the sender (an external event)
// and keeps the sender's memory unused meanwhile (a graph's private pool).
#include "peer.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace mpstream {

at::Tensor peer_view(const at::Tensor& src, c10::Device device) {
  TORCH_CHECK(src.device().type() == device.type(), "peer_view: a tensor on ", src.device(),
              " cannot be viewed from ", device, " (another kind of device)");
  TORCH_CHECK(device.has_index() || device.is_cpu(), "peer_view: ", device,
              " names no device index");
  TORCH_CHECK(src.layout() == c10::kStrided, "peer_view: only strided tensors, got ",
              src.layout());
  // A view's lazy conjugate or negation lives in its dispatch keys, which a
  // tensor made from a pointer does not carry.
  TORCH_CHECK(!src.is_conj() && !src.is_neg(),
              "peer_view: resolve the tensor's conjugate or negative bit first "
              "(resolve_conj(), resolve_neg())");
  at::Tensor keep = src;  // the view's deleter holds the source's storage
  return at::for_blob(src.data_ptr(), src.sizes())
      .strides(src.strides())
      .deleter([keep](void*) mutable { keep.reset(); })
      .options(src.options().device(device))
      .target_device(device)
      .make_tensor();
}

}  // namespace mpstream
