// Device-page localization probe of the RMP client (rmp_probe.cpp); bound in
// parity_cuda_binding.cpp.  Plain C++ types only.
#pragma once
#include <cstdint>
#include <vector>

namespace leto_rmp {
// Indices (in the order probed) of the pages at base + i * page_bytes whose mapping the driver
// does not know.  idx == nullptr: pages 0..n_pages-1; else the n_idx listed indices.
// Throws std::runtime_error when the driver entry point cannot be found.
std::vector<int64_t> probe_unmapped(uint64_t base, int64_t page_bytes, const int64_t* idx,
                                    int64_t n_idx, int64_t n_pages, int threads);
}  // namespace leto_rmp
