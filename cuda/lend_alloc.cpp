// lend_alloc.cpp -- the segment allocator behind RMU's activation lending (leto_runtime/rmu/lend.py).
//
// What it is: the two C functions a `torch.cuda.memory.CUDAPluggableAllocator` needs
// (`lend_alloc`, `lend_free`), plus a few control functions called through ctypes.  PyTorch's
// CUDA caching allocator calls them for the *segments* of one private pool (a
// `torch.cuda.MemPool` created with this allocator); it carves its blocks out of those segments
// itself, exactly as it does with cudaMalloc'ed segments of its default pool.
//
// What it does: large segment requests (> `small_limit`, default 2 MiB: PyTorch's small-pool
// segments are exactly 2 MiB, kSmallBuffer) are served first-fit from the registered address
// ranges -- RMU's undo buffer U and parity buffers Q/Q', memory that is idle outside the update
// phase.  Small requests, and large ones that do not fit, are cudaMalloc'ed ("overflow").  A
// free returns a region segment to the free list (coalescing neighbours) and cudaFree's the rest.
//
// Why segments and not blocks: the caching allocator keeps freed blocks cached inside their
// segments, so this allocator cannot see which bytes are live; lend.py asks the caching
// allocator (MemPool.snapshot) before RMU writes U/Q.  This file only hands out address ranges
// and never touches their contents.
//
// Reference: PyTorch "CUDA memory management -> Using custom memory allocators for CUDA" and
// "MemPool" (torch.cuda.memory.CUDAPluggableAllocator / MemPool; the alloc signature is
// `void* alloc(ssize_t size, int device, cudaStream_t stream)`, free is
// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`), and c10/cuda/
// CUDACachingAllocator.cpp (a private pool with an allocator calls raw_alloc/raw_delete for its
// segments; large segments are 20 MiB or rounded up to 2 MiB, small segments are 2 MiB).
// The paper (Leto, §5.3 "Minimizing memory and transfer overhead" and §7 "PyTorch memory
// allocator integration") does the same inside Megatron's runtime.
//
// Thread safety: one mutex; the caching allocator may call from the autograd engine's threads.
// Everything is host bookkeeping except the overflow cudaMalloc/cudaFree.
//
// Reclaim before OOM (issue 21; docs/PREINIT.md, "Reclaim before OOM"): with a hook armed
// (`lend_set_reclaim`), the first overflow cudaMalloc that fails for a request asks the agent to
// lower the local shadows (one `reclaim` datagram on the agent's heartbeat socket, the same JSON
// a Python `beats.send` writes), polls cudaMemGetInfo until the request fits with
// `reclaim_slack` to spare, at most `reclaim_wait_s`, then retries once.  It acts at the first
// failure because torch does not always ask twice: while allocations are routed to a pool
// (`_cuda_beginAllocateToPool`, which is how lending works) torch 2.11 skips its
// release-the-cache-and-retry step and raises at once (seen on the H200).  Where torch does ask
// again for the same size (after releasing its cache), that call only retries cudaMalloc: one
// wait per request.  No Python and no GIL on this path: a Python thread that allocates while
// holding the GIL would deadlock a callback that needed it.  Reference: the same request
// through torch's default pool would OOM.
#include <cuda_runtime_api.h>

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include <cstdint>
#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kAlign = 512;          // the caching allocator's block alignment

struct Region {
  uintptr_t base = 0;                   // aligned start
  size_t bytes = 0;
  int device = -1;
  std::map<uintptr_t, size_t> free;     // start -> length, disjoint, coalesced
  size_t in_use = 0;
};

struct Seg {
  size_t bytes;
  int region;                           // -1: cudaMalloc'ed
};

std::mutex mu;
std::vector<Region> regions;
std::unordered_map<uintptr_t, Seg> live;
size_t small_limit = 2u << 20;          // requests <= this never come from a region
int enabled = 1;
// statistics (bytes unless named otherwise)
int64_t region_in_use = 0, region_peak = 0, overflow_in_use = 0, overflow_peak = 0;
int64_t n_region_allocs = 0, n_overflow_allocs = 0, n_region_misses = 0, n_failed = 0;
// the reclaim hook (empty path: off)
std::string reclaim_path, reclaim_head, reclaim_tail;
double reclaim_wait_s = 3.0;
size_t reclaim_slack = 64u << 20;
// The size of this thread's failed request that torch may ask again: per thread, so one
// thread's retry is never taken for another's first failure (another device's, say).
thread_local size_t last_failed = 0;
int64_t n_reclaim_asked = 0, n_reclaim_served = 0;

uintptr_t align_up(uintptr_t x) { return (x + kAlign - 1) & ~(uintptr_t)(kAlign - 1); }

void* take_from_region(size_t size, int device) {
  size = align_up(size);
  for (size_t r = 0; r < regions.size(); ++r) {
    Region& R = regions[r];
    if (R.device != device) continue;
    for (auto it = R.free.begin(); it != R.free.end(); ++it) {
      if (it->second < size) continue;
      uintptr_t p = it->first;
      size_t rest = it->second - size;
      R.free.erase(it);
      if (rest) R.free.emplace(p + size, rest);
      R.in_use += size;
      live.emplace(p, Seg{size, (int)r});
      region_in_use += (int64_t)size;
      if (region_in_use > region_peak) region_peak = region_in_use;
      ++n_region_allocs;
      return reinterpret_cast<void*>(p);
    }
  }
  return nullptr;
}

void give_back(Region& R, uintptr_t p, size_t size) {
  auto next = R.free.lower_bound(p);
  if (next != R.free.end() && p + size == next->first) {   // merge with the following range
    size += next->second;
    next = R.free.erase(next);
  }
  if (next != R.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == p) {                  // merge with the preceding range
      prev->second += size;
      return;
    }
  }
  R.free.emplace(p, size);
}

// What one reclaim needs, copied under the lock so the wait runs without it.
struct Request {
  std::string path, msg;
  double wait_s;
  size_t need;                          // free bytes that let the retry succeed
};

// One datagram; a full queue (net.unix.max_dgram_qlen) is retried for at most 50 ms, as
// beats.py retries its control datagrams.
void send_reclaim(const Request& rq) {
  using namespace std::chrono;
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (rq.path.size() < sizeof(a.sun_path)) {
    std::memcpy(a.sun_path, rq.path.c_str(), rq.path.size() + 1);
    auto deadline = steady_clock::now() + milliseconds(50);
    while (sendto(fd, rq.msg.data(), rq.msg.size(), 0, reinterpret_cast<sockaddr*>(&a),
                  sizeof(a)) < 0 &&
           (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) &&
           steady_clock::now() < deadline)
      std::this_thread::sleep_for(milliseconds(1));
  }
  close(fd);
}

// Ask, then wait until the request fits (bounded).  The device is already the request's.
bool reclaim(const Request& rq) {
  using namespace std::chrono;
  send_reclaim(rq);
  auto deadline = steady_clock::now() + duration<double>(rq.wait_s);
  while (steady_clock::now() < deadline) {
    size_t f = 0, t = 0;
    if (cudaMemGetInfo(&f, &t) == cudaSuccess && f >= rq.need) return true;
    cudaGetLastError();
    std::this_thread::sleep_for(milliseconds(2));
  }
  return false;
}

}  // namespace

extern "C" {

// ---- the CUDAPluggableAllocator pair ------------------------------------------------------
void* lend_alloc(ssize_t size, int device, cudaStream_t /*stream*/) {
  if (size <= 0) return nullptr;
  std::unique_lock<std::mutex> g(mu);
  if (enabled && (size_t)size > small_limit) {
    if (void* p = take_from_region((size_t)size, device)) return p;
    if (!regions.empty()) ++n_region_misses;
  }
  void* p = nullptr;
  int prev = -1;
  cudaGetDevice(&prev);
  if (prev != device) cudaSetDevice(device);
  cudaError_t err = cudaMalloc(&p, (size_t)size);
  if (err == cudaErrorMemoryAllocation && !reclaim_path.empty()) {
    cudaGetLastError();
    if (last_failed == (size_t)size) {  // torch asked again after releasing its own cache:
      last_failed = 0;                  // that cudaMalloc above was the retry
    } else {
      last_failed = (size_t)size;
      ++n_reclaim_asked;
      Request rq{reclaim_path, reclaim_head + std::to_string(size) + reclaim_tail,
                 reclaim_wait_s, (size_t)size + reclaim_slack};
      g.unlock();                       // frees and other threads' allocations go on meanwhile
      bool fits = reclaim(rq);
      if (fits) err = cudaMalloc(&p, (size_t)size);
      g.lock();
      if (fits && err == cudaSuccess) ++n_reclaim_served;
      if (err != cudaSuccess) cudaGetLastError();
    }
  }
  if (prev != device && prev >= 0) cudaSetDevice(prev);
  if (err != cudaSuccess) {
    cudaGetLastError();                 // clear the sticky-free error; PyTorch handles the OOM
    ++n_failed;
    return nullptr;
  }
  last_failed = 0;
  live.emplace(reinterpret_cast<uintptr_t>(p), Seg{(size_t)size, -1});
  overflow_in_use += size;
  if (overflow_in_use > overflow_peak) overflow_peak = overflow_in_use;
  ++n_overflow_allocs;
  return p;
}

void lend_free(void* ptr, ssize_t /*size*/, int /*device*/, cudaStream_t /*stream*/) {
  if (!ptr) return;
  std::lock_guard<std::mutex> g(mu);
  auto it = live.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live.end()) return;         // not ours (never happens with one pool)
  Seg s = it->second;
  live.erase(it);
  if (s.region >= 0) {
    Region& R = regions[(size_t)s.region];
    give_back(R, reinterpret_cast<uintptr_t>(ptr), s.bytes);
    R.in_use -= s.bytes;
    region_in_use -= (int64_t)s.bytes;
  } else {
    cudaFree(ptr);                      // the caching allocator synchronized before releasing
    overflow_in_use -= (int64_t)s.bytes;
  }
}

// ---- control (ctypes) -----------------------------------------------------------------------
// Register [base, base + bytes) on `device`; returns the region id, or -1 if it overlaps one.
int lend_add_region(uintptr_t base, size_t bytes, int device) {
  std::lock_guard<std::mutex> g(mu);
  uintptr_t a = align_up(base);
  if (bytes <= a - base) return -1;
  size_t usable = (bytes - (a - base)) & ~(size_t)(kAlign - 1);
  for (auto& R : regions)
    if (R.bytes && a < R.base + R.bytes && R.base < a + usable) return -1;
  Region R;
  R.base = a;
  R.bytes = usable;
  R.device = device;
  R.free.emplace(a, usable);
  regions.push_back(std::move(R));
  return (int)regions.size() - 1;
}

// Forget every region; refused (returns the bytes still lent) while segments are out.
int64_t lend_clear_regions() {
  std::lock_guard<std::mutex> g(mu);
  if (region_in_use) return region_in_use;
  regions.clear();
  return 0;
}

// Arm the reclaim hook: datagrams to `path` read `head` + the request's bytes + `tail`; wait at
// most `wait_s` for the memory.  An empty path disarms it.
void lend_set_reclaim(const char* path, const char* head, const char* tail, double wait_s) {
  std::lock_guard<std::mutex> g(mu);
  reclaim_path = path ? path : "";
  reclaim_head = head ? head : "";
  reclaim_tail = tail ? tail : "";
  reclaim_wait_s = wait_s;
  last_failed = 0;
}

void lend_set_small_limit(size_t bytes) { std::lock_guard<std::mutex> g(mu); small_limit = bytes; }
void lend_set_enabled(int on) { std::lock_guard<std::mutex> g(mu); enabled = on; }

// 1 if ptr lies in a registered region.
int lend_in_region(uintptr_t p) {
  std::lock_guard<std::mutex> g(mu);
  for (auto& R : regions)
    if (p >= R.base && p < R.base + R.bytes) return 1;
  return 0;
}

// out[0..10]: region bytes, region in use, region peak, overflow in use, overflow peak,
// region allocs, overflow allocs, region misses, failed allocs, live segments, regions,
// reclaims asked, reclaims that made the retry succeed.
void lend_stats(int64_t* out) {
  std::lock_guard<std::mutex> g(mu);
  int64_t total = 0;
  for (auto& R : regions) total += (int64_t)R.bytes;
  out[0] = total; out[1] = region_in_use; out[2] = region_peak; out[3] = overflow_in_use;
  out[4] = overflow_peak; out[5] = n_region_allocs; out[6] = n_overflow_allocs;
  out[7] = n_region_misses; out[8] = n_failed; out[9] = (int64_t)live.size();
  out[10] = (int64_t)regions.size(); out[11] = n_reclaim_asked; out[12] = n_reclaim_served;
}

void lend_reset_peaks() {
  std::lock_guard<std::mutex> g(mu);
  region_peak = region_in_use;
  overflow_peak = overflow_in_use;
}

}  // extern "C"
