// The benchmarks' build of adamw_ws.cu (extension `leto_rmu_fold`, fused.load_fold): the same
// kernels, plus the folded chunk counting every 2 or 4 stages instead of every stage (one
// fence per batch; fused.BENCH_KERNELS "ws-fold+counts/2", "/4"), which the updater's build
// leaves out until they are measured.  Reference: adamw_ws.cu's count of every stage (the same
// states, parity, undo copy and final counts; Fused.syndrome_check).
#define LETO_WS_COUNT_BATCHES 1
#include "adamw_ws.cu"
