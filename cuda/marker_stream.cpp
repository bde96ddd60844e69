// Stream-ordered writes of RMU's progress marker into host memory (cudaLaunchHostFunc).
//
// Role: the paper's "lightweight CUDA kernels update the marker in the same stream after each
// RMU GPU operation" (§5.2).  The updater queues a marker write right behind the operation it
// claims; the write happens when the stream reaches it, and work queued after it waits for it.
// So the host never blocks on the stream between operations (a fence per operation left the
// GPU idle ~40% of the update phase on the H200), yet a marker never claims work the GPU has not
// finished, and an operation never starts before the marker that guards it is written.
//
// What is written is decided on the host at queue time (leto_runtime/rmu/marker.py keeps a
// mirror of the marker block and its parity rows as they will be after every queued write):
// the payload is an ordered list of (destination, bytes) segments -- the new record slot and the
// patched parity rows, then the `cur` word, then the parity rows again.  They are applied in
// order by plain CPU stores (x86 keeps store order; a release fence between segments states it
// for the compiler and other CPUs); an 8-byte aligned segment of 8 bytes (the `cur` flip) is one
// atomic store, which a SIGKILL cannot tear -- the same guarantees as Marker.write's host path.
//
// The host function runs on a CUDA driver thread and takes no Python lock.  It must not call
// CUDA (it does not).  Reference: Marker.write (the synchronous host path, same bytes).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "marker_kernel.h"

namespace {

struct Segment {
  uint8_t* dst;
  size_t offset;  // into Payload::bytes
  size_t n;
};

struct Payload {
  std::vector<Segment> segs;
  std::vector<uint8_t> bytes;
};

void CUDART_CB apply(void* user) {
  Payload* p = static_cast<Payload*>(user);
  for (const Segment& s : p->segs) {
    const uint8_t* src = p->bytes.data() + s.offset;
    if (s.n == 8 && reinterpret_cast<uintptr_t>(s.dst) % 8 == 0) {
      uint64_t v;
      std::memcpy(&v, src, 8);
      __atomic_store_n(reinterpret_cast<uint64_t*>(s.dst), v, __ATOMIC_RELEASE);
    } else {
      std::memcpy(s.dst, src, s.n);
    }
    std::atomic_thread_fence(std::memory_order_release);
  }
  delete p;
}

// Segment i: sizes[i] bytes of `data` (consecutive, in order) to address dsts[i], applied in
// order when the current stream of `device` reaches this point.  The bytes are copied now: the
// caller may reuse its buffers at once.
void marker_write_async(const torch::Tensor& dsts, const torch::Tensor& sizes, const torch::Tensor& data,
                        const torch::Device& device) {
  TORCH_CHECK(device.is_cuda(), "marker_write_async: device must be CUDA, got ", device);
  for (const torch::Tensor* t : {&dsts, &sizes})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->dim() == 1 && t->is_contiguous(),
                "marker_write_async: dsts and sizes must be contiguous 1-D int64 CPU tensors");
  TORCH_CHECK(dsts.numel() == sizes.numel(), "marker_write_async: one size per destination");
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == torch::kUInt8 && data.is_contiguous(),
              "marker_write_async: data must be a contiguous uint8 CPU tensor");
  const int64_t* d = dsts.data_ptr<int64_t>();
  const int64_t* n = sizes.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < dsts.numel(); ++i) {
    TORCH_CHECK(d[i] != 0 && n[i] >= 0, "marker_write_async: bad segment ", i);
    total += n[i];
  }
  TORCH_CHECK(total == data.numel(), "marker_write_async: the sizes add up to ", total, " bytes, data has ",
              data.numel());
  auto* p = new Payload();
  p->bytes.assign(data.data_ptr<uint8_t>(), data.data_ptr<uint8_t>() + total);
  size_t off = 0;
  for (int64_t i = 0; i < dsts.numel(); ++i) {
    p->segs.push_back({reinterpret_cast<uint8_t*>(d[i]), off, static_cast<size_t>(n[i])});
    off += static_cast<size_t>(n[i]);
  }
  const c10::cuda::CUDAGuard guard(device);
  const cudaError_t e = cudaLaunchHostFunc(c10::cuda::getCurrentCUDAStream().stream(), apply, p);
  if (e != cudaSuccess) {
    delete p;
    TORCH_CHECK(false, "marker_write_async: cudaLaunchHostFunc: ", cudaGetErrorString(e));
  }
}

// The device-side variant (marker_kernel.cu): the payload is already in `staging` (pinned host
// memory the caller keeps until the kernel ran); dsts are device-visible addresses
// (host_device_pointer); fences[i] = 1 ends a group of segments that is in memory before the
// next group starts.
void marker_write_device(const torch::Tensor& dsts, const torch::Tensor& sizes, const torch::Tensor& fences,
                         const torch::Tensor& staging, const torch::Device& device) {
  TORCH_CHECK(device.is_cuda(), "marker_write_device: device must be CUDA, got ", device);
  for (const torch::Tensor* t : {&dsts, &sizes, &fences})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->dim() == 1 && t->is_contiguous() &&
                    t->numel() == dsts.numel(),
                "marker_write_device: dsts, sizes and fences must be contiguous int64 CPU tensors of one length");
  TORCH_CHECK(dsts.numel() <= leto_rmu::kMaxMarkerSegments, "marker_write_device: at most ",
              leto_rmu::kMaxMarkerSegments, " segments");
  TORCH_CHECK(staging.device().is_cpu() && staging.is_pinned() && staging.scalar_type() == torch::kUInt8 &&
                  staging.is_contiguous(), "marker_write_device: staging must be a pinned contiguous uint8 tensor");
  void* src = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&src, staging.data_ptr(), 0);
  if (e != cudaSuccess) {
    cudaGetLastError();   // a failed call must not surface at the next launch check
    TORCH_CHECK(false, "marker_write_device: staging is not device-mapped: ", cudaGetErrorString(e));
  }
  leto_rmu::MarkerSegments a{};
  a.n = static_cast<int>(dsts.numel());
  a.src = static_cast<const uint8_t*>(src);
  int64_t off = 0;
  for (int i = 0; i < a.n; ++i) {
    a.dst[i] = reinterpret_cast<uint8_t*>(dsts.data_ptr<int64_t>()[i]);
    a.size[i] = static_cast<int>(sizes.data_ptr<int64_t>()[i]);
    a.offset[i] = off;
    a.fence_after[i] = fences.data_ptr<int64_t>()[i] ? 1 : 0;
    off += a.size[i];
  }
  TORCH_CHECK(off <= staging.numel(), "marker_write_device: the segments need ", off, " bytes, staging has ",
              staging.numel());
  const c10::cuda::CUDAGuard guard(device);
  try {
    leto_rmu::marker_write_device(a, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& ex) {
    TORCH_CHECK(false, "leto rmu CUDA: ", ex.what());
  }
}

// Page-lock [addr, addr + n) for device access (cudaHostRegisterMapped).  Returns false when it
// is already registered (by someone else: the RMP client pins parity ranges), true when this
// call registered it (the caller unregisters it with host_unregister).
bool host_register(int64_t addr, int64_t n) {
  const cudaError_t e = cudaHostRegister(reinterpret_cast<void*>(addr), static_cast<size_t>(n),
                                         cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e == cudaSuccess) return true;
  cudaGetLastError();     // every failure is reported here, never at the next launch check
  if (e == cudaErrorHostMemoryAlreadyRegistered) return false;
  TORCH_CHECK(false, "host_register: cudaHostRegister: ", cudaGetErrorString(e));
  return false;
}

void host_unregister(int64_t addr) {
  const cudaError_t e = cudaHostUnregister(reinterpret_cast<void*>(addr));
  if (e != cudaSuccess) {
    cudaGetLastError();
    TORCH_CHECK(false, "host_unregister: cudaHostUnregister: ", cudaGetErrorString(e));
  }
}

// The device-visible address of registered host memory (equal to addr where the GPU can use host
// pointers of registered memory).
int64_t host_device_pointer(int64_t addr) {
  void* d = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&d, reinterpret_cast<void*>(addr), 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    TORCH_CHECK(false, "host_device_pointer: ", cudaGetErrorString(e), " (is the memory registered?)");
  }
  return reinterpret_cast<int64_t>(d);
}

}  // namespace

void register_marker_stream(pybind11::module& m) {
  m.def("marker_write_async", &marker_write_async,
        "queue ordered host-memory writes (dsts[i] <- sizes[i] bytes of data) on the current CUDA stream",
        py::arg("dsts"), py::arg("sizes"), py::arg("data"), py::arg("device"));
  m.def("marker_write_device", &marker_write_device,
        "queue the same writes as one small kernel storing into registered host memory",
        py::arg("dsts"), py::arg("sizes"), py::arg("fences"), py::arg("staging"), py::arg("device"));
  m.def("host_register", &host_register, "cudaHostRegister (mapped); False if already registered",
        py::arg("addr"), py::arg("n"));
  m.def("host_unregister", &host_unregister, py::arg("addr"));
  m.def("host_device_pointer", &host_device_pointer, py::arg("addr"));
}
