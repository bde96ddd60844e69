// Host-side argument checks of the fused AdamW kernels' torch bindings (adamw_binding.cpp, and
// adamw_fold_binding.cpp for the benchmarks' folded chunk): tensor checks, torch's conversion of
// the Python scalars, and the arguments of one chunk kernel.  Header-only; one copy per binding.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "adamw_cuda.h"
#include "adamw_syndrome.h"

namespace {

void check(const torch::Tensor& t, const torch::Tensor& like, const char* name, torch::ScalarType dt) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "adamw_fused: ", name, " must be on ", like.device());
  TORCH_CHECK(t.scalar_type() == dt && t.dim() == 1 && t.is_contiguous() && t.numel() == like.numel(),
              "adamw_fused: ", name, " must be a contiguous 1-D tensor of ", like.numel(), " elements of ", dt);
}

// Python floats become fp32 the way c10::Scalar::to<float> converts a double (round to nearest).
// `v.sqrt() / x` multiplies by the reciprocal of the CPU scalar x, taken in double and then
// rounded (tests/gpu/test_rmu_fused_gpu.py: 1.0f / float(x) differs for x = sqrt(1 - 0.999)).
leto_rmu::AdamWScalars scalars(double decay, double beta1, double beta2, double eps, double bc2_sqrt,
                               double step_size, bool has_coef, bool has_decay) {
  leto_rmu::AdamWScalars s{};
  s.decay = static_cast<float>(decay);
  s.w1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.w2 = static_cast<float>(1.0 - beta2);
  s.inv_bc2 = static_cast<float>(1.0 / bc2_sqrt);
  s.inv_bc2_f = 1.0f / static_cast<float>(bc2_sqrt);
  s.eps = static_cast<float>(eps);
  s.nstep = static_cast<float>(-step_size);
  s.has_coef = has_coef ? 1 : 0;
  s.has_decay = has_decay ? 1 : 0;
  return s;
}

// The arguments of one chunk kernel (both kernels): states p, m, v, gradients g, undo copies
// up, um, uv; outs / bases: int64 CUDA tensors of 3 x m_out page addresses; mix: int32 CPU
// (m_out, 16) coefficients (t = -7..8); scale: int32 CPU (16,) run scale.
struct ChunkCall {
  SyndromeArgs a{};
  leto_rmu::AdamWSyndromeArgs f{};
  std::vector<uint16_t> coef;
};

ChunkCall chunk_call(torch::Tensor& p, torch::Tensor& m, torch::Tensor& v, const torch::Tensor& g,
                     const torch::Tensor& up, const torch::Tensor& um, const torch::Tensor& uv,
                     const std::optional<torch::Tensor>& coef, const torch::Tensor& outs, const torch::Tensor& bases,
                     const torch::Tensor& mix, const torch::Tensor& scale, int64_t page_bytes, double decay,
                     double beta1, double beta2, double eps, double bc2_sqrt, double step_size, bool has_decay) {
  for (auto* t : {&p, &m, &v}) check(*t, p, "state", torch::kFloat32);
  check(g, p, "g", torch::kFloat32);
  for (const auto* t : {&up, &um, &uv}) check(*t, p, "undo", torch::kFloat32);
  TORCH_CHECK(page_bytes > 0 && page_bytes % 1024 == 0 && (p.numel() * 4) % page_bytes == 0,
              "adamw_syndrome: the chunk must be whole pages of a multiple of 1024 bytes");
  // Each kernel reads or writes every one of these buffers: overlap would race.
  const auto span = [](const torch::Tensor& t) {
    const auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(b, b + static_cast<uintptr_t>(t.numel()) * 4);
  };
  const torch::Tensor* all[] = {&p, &m, &v, &up, &um, &uv, &g};
  for (int i = 0; i < 7; ++i)
    for (int j = i + 1; j < 7; ++j) {
      const auto x = span(*all[i]), y = span(*all[j]);
      TORCH_CHECK(x.second <= y.first || y.second <= x.first,
                  "adamw_syndrome: the states, undo copies and gradients must not overlap");
    }
  for (const auto* t : {&outs, &bases})
    TORCH_CHECK(t->is_cuda() && t->device() == p.device() && t->scalar_type() == torch::kInt64 &&
                    t->dim() == 1 && t->is_contiguous() && t->numel() % 3 == 0,
                "adamw_syndrome: outs and bases must be int64 CUDA tensors of 3 x m_out page addresses");
  TORCH_CHECK(outs.numel() == bases.numel(), "adamw_syndrome: one base page per output page");
  const int64_t m_out = outs.numel() / 3;
  TORCH_CHECK(m_out >= 1 && m_out <= 16, "adamw_syndrome: 1..16 parity pages per state");
  TORCH_CHECK(!mix.is_cuda() && mix.scalar_type() == torch::kInt32 && mix.is_contiguous() && mix.numel() == m_out * 16,
              "adamw_syndrome: mix must be a contiguous int32 CPU tensor of shape (m_out, 16)");
  TORCH_CHECK(!scale.is_cuda() && scale.scalar_type() == torch::kInt32 && scale.is_contiguous() && scale.numel() == 16,
              "adamw_syndrome: scale must be a contiguous int32 CPU tensor of 16 GF(2^16) values");
  ChunkCall c;
  c.coef.resize(static_cast<size_t>(m_out * 16));
  for (size_t i = 0; i < c.coef.size(); ++i) c.coef[i] = static_cast<uint16_t>(mix.data_ptr<int32_t>()[i]);
  c.a.n = static_cast<int>(p.numel() * 4 / page_bytes);
  c.a.outs = reinterpret_cast<uint8_t* const*>(outs.data_ptr<int64_t>());
  c.a.bases = reinterpret_cast<const uint8_t* const*>(bases.data_ptr<int64_t>());
  c.a.m_out = static_cast<int>(m_out);
  c.a.page_bytes = page_bytes;
  c.a.scaled = 1;
  for (int t = 0; t < 16; ++t) c.a.scale[t] = static_cast<uint32_t>(scale.data_ptr<int32_t>()[t]) & 0xFFFFu;
  c.f.state[0] = p.data_ptr<float>();
  c.f.state[1] = m.data_ptr<float>();
  c.f.state[2] = v.data_ptr<float>();
  float* u[3] = {up.data_ptr<float>(), um.data_ptr<float>(), uv.data_ptr<float>()};
  for (int i = 0; i < 3; ++i) c.f.old[i] = c.f.undo[i] = u[i];
  c.f.g = g.data_ptr<float>();
  if (coef) {
    TORCH_CHECK(coef->is_cuda() && coef->device() == p.device() && coef->scalar_type() == torch::kFloat32 &&
                    coef->numel() == 1, "adamw_syndrome: coef must be a 1-element fp32 tensor on ", p.device());
    c.f.coef = coef->data_ptr<float>();
  }
  c.f.s = scalars(decay, beta1, beta2, eps, bc2_sqrt, step_size, coef.has_value(), has_decay);
  return c;
}

// The folded chunk's stage counts (adamw_ws.cu): two int64 copies of one word per 512-byte unit
// of a page (the grid's tiles x 4 producer warps), the transaction's tag, a count every `batch`
// stages.
void set_counts(ChunkCall& c, const torch::Tensor& p, torch::Tensor& counts0, torch::Tensor& counts1, int64_t tag,
                int64_t page_bytes, int64_t batch) {
  const int64_t units = (page_bytes / 1024 + 1) / 2 * 4;
  for (const auto* t : {&counts0, &counts1})
    TORCH_CHECK(t->is_cuda() && t->device() == p.device() && t->scalar_type() == torch::kInt64 &&
                    t->is_contiguous() && t->numel() == units,
                "adamw_syndrome_fold: counts must be contiguous int64 tensors of ", units, " words on ", p.device());
  TORCH_CHECK(tag >= 0 && tag < (int64_t{1} << 48), "adamw_syndrome_fold: tag must be in [0, 2^48)");
  TORCH_CHECK(batch == 1 || batch == 2 || batch == 4, "adamw_syndrome_fold: a count every 1, 2 or 4 stages");
  c.f.counts[0] = reinterpret_cast<uint64_t*>(counts0.data_ptr<int64_t>());
  c.f.counts[1] = reinterpret_cast<uint64_t*>(counts1.data_ptr<int64_t>());
  c.f.tag = static_cast<uint64_t>(tag);
  c.f.count_batch = static_cast<int>(batch);
}

}  // namespace
