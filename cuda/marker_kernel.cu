// Device-side marker writes: the stream-ordered marker write of marker_stream.cpp done by a
// one-block kernel that stores the payload into (registered, device-mapped) host memory, instead
// of a host function.  A host function holds the stream for a round trip to a CUDA driver
// thread; the kernel takes a few microseconds of PCIe writes (docs/BENCHMARKS.md).
//
// Same contract and bytes as marker_stream.cpp's apply(), with the order stated explicitly:
// segments come in groups (fence_after ends one); a group is complete and visible to the host
// (__threadfence_system) before the next begins, and a group of one 8-byte word (the `cur`
// flip) is one 8-byte store.  The payload is read from pinned
// host memory (a staging slot the caller keeps until the kernel has run).  Reference:
// Marker.write (the host path), through tests/gpu/test_marker_stream_gpu.py.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "marker_kernel.h"

namespace {

// Where word w of a group of segments first..last lives: (segment, word within it).
__device__ __forceinline__ void locate(const leto_rmu::MarkerSegments& s, int first, int last, int w,
                                       int& seg, int& word) {
  seg = first;
  while (seg < last && w >= s.size[seg] / 8) {
    w -= s.size[seg] / 8;
    ++seg;
  }
  word = w;
}

__global__ void __launch_bounds__(1024) marker_write_kernel(const leto_rmu::MarkerSegments s) {
  // Groups of segments end where fence_after is set: a group's words are spread over all
  // threads (no order inside a group), then fenced before the next group starts.
  int first = 0;
  while (first < s.n) {
    int last = first;
    while (last < s.n - 1 && !s.fence_after[last]) ++last;
    int total = 0;
    for (int i = first; i <= last; ++i) total += s.size[i] / 8;
    if (total == 1) {
      if (threadIdx.x == 0)     // one 8-byte store: the `cur` flip cannot be torn
        *reinterpret_cast<volatile uint64_t*>(s.dst[first]) =
            *reinterpret_cast<const uint64_t*>(s.src + s.offset[first]);
    } else {
      constexpr int kMax = leto_rmu::kMaxMarkerWordsPerThread;
      uint64_t v[kMax];
      // All loads first (one PCIe round trip for the block), then the stores.
#pragma unroll
      for (int k = 0; k < kMax; ++k) {
        const int w = threadIdx.x + k * blockDim.x;
        if (w < total) {
          int seg, word;
          locate(s, first, last, w, seg, word);
          v[k] = reinterpret_cast<const uint64_t*>(s.src + s.offset[seg])[word];
        }
      }
#pragma unroll
      for (int k = 0; k < kMax; ++k) {
        const int w = threadIdx.x + k * blockDim.x;
        if (w < total) {
          int seg, word;
          locate(s, first, last, w, seg, word);
          reinterpret_cast<uint64_t*>(s.dst[seg])[word] = v[k];
        }
      }
    }
    // Every thread's stores of this group are visible system-wide before it reaches the barrier,
    // so none of the next group's stores (the `cur` flip among them) can be seen before them.
    __threadfence_system();
    __syncthreads();
    first = last + 1;
  }
}

}  // namespace

namespace leto_rmu {

void marker_write_device(const MarkerSegments& s, cudaStream_t stream) {
  if (s.n < 0 || s.n > kMaxMarkerSegments) throw std::runtime_error("marker_write_device: too many segments");
  int64_t group = 0;
  for (int i = 0; i < s.n; ++i) {
    if (s.size[i] <= 0 || s.size[i] % 8 || s.offset[i] % 8 || reinterpret_cast<uintptr_t>(s.dst[i]) % 8 ||
        s.dst[i] == nullptr)
      throw std::runtime_error("marker_write_device: segments must be non-empty, whole, aligned 8-byte words");
    group += s.size[i] / 8;
    if (group > 1024LL * kMaxMarkerWordsPerThread)
      throw std::runtime_error("marker_write_device: more than 40 KiB between two fences");
    if (s.fence_after[i] || i == s.n - 1) group = 0;
  }
  marker_write_kernel<<<1, 1024, 0, stream>>>(s);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("marker_write_device launch: ") + cudaGetErrorString(e));
}

}  // namespace leto_rmu
