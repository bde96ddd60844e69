// Launch interface of the device-side marker write (marker_kernel.cu), used by marker_stream.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace leto_rmu {

// A write is 2 (H1 + H2) + 2 segments; H1 <= 16 and H2 <= H1 give at most 66, and the largest
// group (slot + H1 + H2 rows) 16 + 32 * 128 words.  leto_runtime/rmu/marker.py checks both.
constexpr int kMaxMarkerSegments = 66;
constexpr int kMaxMarkerWordsPerThread = 5;   // x 1024 threads x 8 bytes: 40 KiB between fences

struct MarkerSegments {
  int n;
  const uint8_t* src;                   // device-visible payload (pinned host memory)
  uint8_t* dst[kMaxMarkerSegments];     // device-visible destinations (registered host memory)
  int64_t offset[kMaxMarkerSegments];   // of segment i in src
  int size[kMaxMarkerSegments];         // bytes, a multiple of 8
  int fence_after[kMaxMarkerSegments];  // 1: segments up to here are in memory before the next
};

// Queue the ordered writes on `stream`; throws std::runtime_error on a bad argument.
void marker_write_device(const MarkerSegments& s, cudaStream_t stream);

}  // namespace leto_rmu
