// The benchmarks' build of adamw_ws.cu (extension `leto_rmu_fold`, fused.load_fold): the same
// kernels, plus the folded chunk counting every 2 stages (one fence per batch;
// fused.BENCH_KERNELS "ws-fold+counts/2"), which the updater's build leaves out (it has 1 and 4).  Reference: adamw_ws.cu's count of every stage (the same
// states, parity, undo copy and final counts; Fused.syndrome_check).
#define LETO_WS_COUNT_BATCHES 1
#include "adamw_ws.cu"
