// Reading another device's memory on this device's stream: the half of a
// copy between devices that a graph captured on the receiving device can
// hold (see peer.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace mpstream {

// `src`'s memory presented as a tensor on `device` (same sizes, strides and
// dtype), which keeps `src`'s storage alive. Kernels on `device` then read
// it directly, which needs peer access from `device` to `src`'s device.
at::Tensor peer_view(const at::Tensor& src, c10::Device device);

}  // namespace mpstream
