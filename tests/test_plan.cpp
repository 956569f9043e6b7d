#include "testing.h"

#include <train/config.h>
#include <train/device.h>
#include <train/errors.h>
#include <train/host_memory.h>
#include <train/optim.h>
#include <train/plan.h>

#include <torch/version.h>

#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "comma_locale.h"

using namespace train;

namespace {

Config base_config(int64_t global_batch) {
  return parse_config("model: {name: resnet18}\n"
                      "data: {kind: synthetic}\n"
                      "trainer: {global_batch: " + std::to_string(global_batch) + ", epochs: 2}\n",
                      "plan_test.yaml");
}

DeviceProfile cpu_profile(int cores = 4) {
  DeviceProfile d;
  d.kind = "cpu";
  d.name = "test CPU";
  d.cpu_cores = cores;
  return d;
}

DeviceProfile gpu_profile(int cc_major) {
  DeviceProfile d;
  d.kind = "cuda";
  d.name = "test GPU";
  d.cc_major = cc_major;
  d.tf32 = d.bf16 = cc_major >= 8;
  d.cpu_cores = 16;
  d.visible_gpus = 1;
  return d;
}

}  // namespace

TEST_CASE("plan: global = micro x accum x world, exactly", "[plan]") {
  Config c = base_config(256);
  c.tuning.max_micro_batch = 64;
  PlanInputs in;
  in.world_size = 2;
  const Plan p = make_plan(c, cpu_profile(), in);
  CHECK(p.micro_batch == 64);
  CHECK(p.accum_steps == 2);
  CHECK(p.micro_batch * p.accum_steps * p.world_size == p.global_batch);
}

TEST_CASE("plan: max_micro_batch picks the largest exact divisor", "[plan]") {
  Config c = base_config(96);
  c.tuning.max_micro_batch = 40;  // 96 = 32 x 3
  const Plan p = make_plan(c, cpu_profile(), {});
  CHECK(p.micro_batch == 32);
  CHECK(p.accum_steps == 3);
}

TEST_CASE("plan: an inexact split is an error that names the key", "[plan]") {
  Config c = base_config(100);
  PlanInputs in;
  in.world_size = 3;
  CHECK_THROWS_WITH(make_plan(c, cpu_profile(), in), Catch::Contains("trainer.global_batch") && Catch::Contains("3"));
  c = base_config(100);
  c.tuning.micro_batch = 30;
  CHECK_THROWS_AS(make_plan(c, cpu_profile(), {}), ConfigError);
  CHECK_THROWS_WITH(make_plan(c, cpu_profile(), {}), Catch::Contains("tuning.micro_batch"));
}

TEST_CASE("plan: device-dependent decisions", "[plan]") {
  const Config c = base_config(64);
  PlanInputs conv;
  conv.convolutional = true;
  const Plan cpu = make_plan(c, cpu_profile(2), conv);
  CHECK(cpu.precision == "fp32");
  CHECK_FALSE(cpu.tf32);
  CHECK_FALSE(cpu.pin_memory);
  CHECK_FALSE(cpu.cudnn_benchmark);
  CHECK(cpu.threads == 2);
  CHECK(cpu.workers == 1);
  // More threads than cores: as asked, with a warning.
  Config many = c;
  many.trainer.threads = 64;
  const Plan oversubscribed = make_plan(many, cpu_profile(2), conv);
  CHECK(oversubscribed.threads == 64);
  CHECK_THAT(oversubscribed.to_text(), Catch::Contains("64 threads on 2 cores: threads that wait for a core"));
  // OMP_NUM_THREADS (torchrun sets 1 for every rank) is not the thread count; the plan says so.
  DeviceProfile omp = cpu_profile(2);
  omp.omp_num_threads = "1";
  const Plan with_omp = make_plan(c, omp, conv);
  CHECK(with_omp.threads == 2);
  CHECK_THAT(with_omp.to_text(), Catch::Contains("2 cores available to this process; OMP_NUM_THREADS=1 is not read: "
                                                 "set trainer.threads to use fewer"));
  omp.omp_num_threads = "2";
  CHECK_THAT(make_plan(c, omp, conv).to_text(), !Catch::Contains("OMP_NUM_THREADS"));

  const Plan a100 = make_plan(c, gpu_profile(8), conv);
  CHECK(a100.tf32);
  CHECK(a100.pin_memory);
  CHECK(a100.cudnn_benchmark);
  CHECK(a100.workers >= 1);

  const Plan t4 = make_plan(c, gpu_profile(7), conv);
  CHECK_FALSE(t4.tf32);

  PlanInputs dynamic = conv;
  dynamic.static_shapes = false;
  CHECK_FALSE(make_plan(c, gpu_profile(8), dynamic).cudnn_benchmark);
}

TEST_CASE("plan: plan.json does not depend on the global C++ locale", "[plan]") {
  Config c = base_config(64);
  c.optim.lr = 0.25;
  testing::CommaDecimalLocale comma;
  REQUIRE(comma.sample() == "12.345,5");  // a stream made now would write that
  const std::string json = make_plan(c, cpu_profile(), {}).to_json();
  CHECK_THAT(json, Catch::Contains("\"lr\":0.25,") &&
                       Catch::Contains("{\"name\":\"lr\",\"value\":\"0.25\",\"reason\":\"optim.lr"));
  CHECK_THAT(json, !Catch::Contains("0,25"));
}

TEST_CASE("plan: schedule length from epochs or max_steps", "[plan]") {
  Config c = base_config(32);
  c.trainer.epochs = 3;
  c.schedule.warmup_epochs = 0.5;
  Plan p = make_plan(c, cpu_profile(), {});
  finalize_schedule(p, c, 1000);  // 31 whole steps per epoch
  CHECK(p.steps_per_epoch == 31);
  CHECK(p.total_steps == 93);
  CHECK(p.warmup_steps == 16);  // round(0.5 x 31)

  c.trainer.max_steps = 10;
  p = make_plan(c, cpu_profile(), {});
  finalize_schedule(p, c, 1000);
  CHECK(p.total_steps == 10);
  CHECK(p.warmup_steps == 10);
  CHECK_THAT(p.to_text(), Catch::Contains("warmup_epochs x steps/epoch = 16, capped by the run's 10 steps"));

  CHECK_THROWS_WITH(finalize_schedule(p, c, 16), Catch::Contains("larger than the training set"));
}

TEST_CASE("plan: schedule arithmetic on the largest values the config allows neither wraps nor goes negative",
          "[plan]") {
  // The most epochs and warmup epochs the schema takes, over a training set of 2^40 samples at
  // batch 1: epochs x steps per epoch is far above limits::kMaxSteps (and than int64 at 2^62).
  Config c = base_config(1);
  c.trainer.epochs = limits::kMaxEpochs;
  c.schedule.warmup_epochs = static_cast<double>(limits::kMaxEpochs);
  Plan p = make_plan(c, cpu_profile(), {});
  CHECK_THROWS_AS(finalize_schedule(p, c, int64_t{1} << 40), ConfigError);
  CHECK_THROWS_WITH(finalize_schedule(p, c, int64_t{1} << 40),
                    Catch::Contains("key 'trainer.epochs'") && Catch::Contains("optimizer steps"));
  CHECK_THROWS_AS(finalize_schedule(p, c, int64_t{1} << 62), ConfigError);

  // With max_steps the run ends first: no error, and the warmup is capped by the run.
  c.trainer.max_steps = limits::kMaxSteps;
  p = make_plan(c, cpu_profile(), {});
  finalize_schedule(p, c, int64_t{1} << 62);
  CHECK(p.total_steps == limits::kMaxSteps);
  CHECK(p.warmup_steps == limits::kMaxSteps);

  // warmup_steps + warmup_epochs x steps per epoch (2^36 + 10^6 x 2^40, past int64 when summed
  // as integers once the epoch is longer) is capped by the run length, never negative.
  c.trainer.max_steps = 100;
  c.schedule.warmup_steps = limits::kMaxSteps;
  p = make_plan(c, cpu_profile(), {});
  finalize_schedule(p, c, int64_t{1} << 40);
  CHECK(p.total_steps == 100);
  CHECK(p.warmup_steps == 100);
}

TEST_CASE("plan: image batches travel as uint8 to a GPU, and as normalised floats on a CPU", "[plan]") {
  Config c = base_config(64);
  c.data.kind = "image_folder";
  const Plan gpu = make_plan(c, gpu_profile(8), {});
  CHECK(gpu.uint8_batches);
  CHECK(resolve_uint8_batches(c, gpu_profile(7)));
  CHECK_THAT(gpu.to_text(), Catch::Contains("uint8_batches") && Catch::Contains("a quarter of the bytes"));
  CHECK_THAT(gpu.to_json(), Catch::Contains("\"uint8_batches\":true"));
  const Plan cpu = make_plan(c, cpu_profile(), {});
  CHECK_FALSE(cpu.uint8_batches);
  CHECK_THAT(cpu.to_text(), Catch::Contains("the loader's workers normalise"));
  // What the config sets wins, with the key as the reason.
  c.data.uint8 = "on";
  const Plan forced = make_plan(c, cpu_profile(), {});
  CHECK(forced.uint8_batches);
  CHECK_THAT(forced.to_text(), Catch::Contains("data.uint8"));
  c.data.uint8 = "off";
  CHECK_FALSE(make_plan(c, gpu_profile(8), {}).uint8_batches);
  // Other data has no uint8 form: auto is off, and the plan does not list the decision.
  Config tokens = base_config(64);
  tokens.data.kind = "tokens";
  const Plan token_plan = make_plan(tokens, gpu_profile(8), {});
  CHECK_FALSE(token_plan.uint8_batches);
  CHECK_THAT(token_plan.to_text(), !Catch::Contains("uint8_batches"));
}

TEST_CASE("plan: text and JSON carry every decision", "[plan]") {
  const Plan p = make_plan(base_config(64), cpu_profile(), {});
  const std::string text = p.to_text();
  for (const char* key : {"micro_batch", "accum_steps", "precision", "workers", "pin_memory", "threads"}) {
    CHECK_THAT(text, Catch::Contains(key));
  }
  const std::string json = p.to_json();
  for (const char* key : {"\"device\"", "\"micro_batch\"", "\"accum_steps\"", "\"global_batch\"", "\"world_size\"",
                          "\"lr\"", "\"warmup_steps\"", "\"precision\"", "\"channels_last\"", "\"cudnn_benchmark\"",
                          "\"workers\"", "\"pin_memory\"", "\"model_params\"", "\"decisions\""}) {
    CHECK_THAT(json, Catch::Contains(key));
  }
}

TEST_CASE("schedules: warmup, cosine, step, constant", "[schedule]") {
  ScheduleConfig s;
  s.name = "cosine";
  s.min_lr_ratio = 0.1;
  const LrSchedule cosine(s, 1.0, 110, 10);
  CHECK(cosine.at(0) == Approx(0.1));  // warmup: (step+1)/warmup
  CHECK(cosine.at(9) == Approx(1.0));
  CHECK(cosine.at(10) == Approx(1.0));
  CHECK(cosine.at(60) == Approx(0.1 + 0.9 * 0.5));  // half way through the decay
  CHECK(cosine.at(110) == Approx(0.1));
  CHECK(cosine.at(500) == Approx(0.1));  // clamps past the end

  s.name = "step";
  s.milestones = {0.5, 0.75};
  s.gamma = 0.1;
  const LrSchedule step(s, 2.0, 100, 0);
  CHECK(step.at(49) == Approx(2.0));
  CHECK(step.at(50) == Approx(0.2));
  CHECK(step.at(75) == Approx(0.02));

  s.name = "constant";
  const LrSchedule constant(s, 0.3, 100, 4);
  CHECK(constant.at(1) == Approx(0.15));
  CHECK(constant.at(50) == Approx(0.3));
}

TEST_CASE("plan: precision and layout per device", "[plan]") {
  const Config c = base_config(64);
  PlanInputs conv;
  conv.convolutional = true;
  const Plan h100 = make_plan(c, gpu_profile(9), conv);
  CHECK(h100.precision == "bf16");
  CHECK(h100.tf32);
  CHECK(h100.channels_last);
  const Plan t4 = make_plan(c, gpu_profile(7), conv);
  CHECK(t4.precision == "fp16");
  CHECK(t4.loss_scaling);
  CHECK_FALSE(t4.tf32);
  CHECK(t4.channels_last);
  CHECK_FALSE(h100.loss_scaling);
  CHECK(make_plan(c, gpu_profile(6), conv).precision == "fp32");  // no tensor cores
  const Plan cpu = make_plan(c, cpu_profile(), conv);
  CHECK(cpu.precision == "fp32");
  CHECK_THAT(cpu.to_text(), !Catch::Contains("AMX"));
  DeviceProfile amx = cpu_profile();
  amx.cpu_isa = "amx_tile avx512_bf16 avx512f avx2 fma";
  CHECK(make_plan(c, amx, conv).precision == "fp32");  // the CPU default stays fp32, and the plan says what bf16 would do
  CHECK_THAT(make_plan(c, amx, conv).to_text(), Catch::Contains("AMX tile units") && Catch::Contains("precision.mode: bf16"));
  CHECK_FALSE(cpu.channels_last);  // no oneDNN
  CHECK_THAT(cpu.to_text(), Catch::Contains("no oneDNN"));
  DeviceProfile onednn = cpu_profile();
  onednn.onednn = true;
  PlanInputs wide = conv;
  wide.narrowest_conv = 16;
  CHECK(make_plan(c, onednn, wide).channels_last);
  CHECK_THAT(make_plan(c, onednn, wide).to_text(), Catch::Contains("oneDNN's convolutions run on NHWC") &&
                                                       Catch::Contains("16+ channels each"));
  CHECK_FALSE(make_plan(c, cpu_profile(), wide).channels_last);  // no oneDNN
  PlanInputs narrow = conv;
  narrow.narrowest_conv = 6;  // LeNet
  CHECK_FALSE(make_plan(c, onednn, narrow).channels_last);
  CHECK_THAT(make_plan(c, onednn, narrow).to_text(), Catch::Contains("6 output channels would fill less than a 16-lane"));
  CHECK_FALSE(make_plan(c, onednn, conv).channels_last);  // widths unknown
  CHECK_FALSE(make_plan(c, onednn, PlanInputs{}).channels_last);  // not a conv net
  PlanInputs mlp;
  CHECK_FALSE(make_plan(c, gpu_profile(8), mlp).channels_last);

  Config bf16 = c;
  bf16.precision.mode = "bf16";
  CHECK(make_plan(bf16, cpu_profile(), conv).precision == "bf16");  // CPU autocast
  CHECK_THROWS_WITH(make_plan(bf16, gpu_profile(7), conv), Catch::Contains("precision.mode"));
  Config fp16 = c;
  fp16.precision.mode = "fp16";
  CHECK(make_plan(fp16, gpu_profile(9), conv).loss_scaling);
  CHECK_THROWS_WITH(make_plan(fp16, cpu_profile(), conv), Catch::Contains("precision.mode"));
  fp16.precision.loss_scaling = "off";
  CHECK_FALSE(make_plan(fp16, gpu_profile(9), conv).loss_scaling);
  CHECK_THAT(make_plan(fp16, gpu_profile(9), conv).to_text(), Catch::Contains("WARNING"));
  Config off = c;
  off.precision.channels_last = "off";
  CHECK_FALSE(make_plan(off, gpu_profile(9), conv).channels_last);
}

TEST_CASE("plan: measured memory bounds the micro-batch and keeps the global batch exact", "[plan]") {
  Config c = base_config(256);
  PlanInputs in;
  in.memory.max_micro_batch = 100;  // largest divisor of 256 within 100 is 64
  in.memory.fixed_bytes = int64_t{2} << 30;
  in.memory.per_sample_bytes = 38.0 * (1 << 20);
  in.memory.budget_bytes = int64_t{72} << 30;
  in.memory.source = "probe on cuda:0 at 8, 16, 32";
  const Plan p = make_plan(c, gpu_profile(8), in);
  CHECK(p.micro_batch == 64);
  CHECK(p.accum_steps == 4);
  CHECK(p.global_batch == 256);
  CHECK(p.lr == Approx(c.optim.lr));
  CHECK_THAT(p.to_text(), Catch::Contains("measured memory fits 100") && Catch::Contains("38 MiB/sample"));

  in.memory.throughput = {{16, 1000.0}, {32, 1900.0}, {64, 1950.0}};
  in.memory.throughput_choice = 32;  // doubling past 32 gained < 5%
  const Plan q = make_plan(c, gpu_profile(8), in);
  CHECK(q.micro_batch == 32);
  CHECK(q.accum_steps == 8);
  CHECK_THAT(q.to_text(), Catch::Contains("gained < 5%"));
}

TEST_CASE("plan: the throughput choice caps the micro-batch only when a larger size was timed", "[plan]") {
  // A per-rank batch of 24: the probe timed powers of two up to it, so only 16, which is its
  // choice by default; 24 itself was never timed and fits, so it runs in one pass.
  Config c = base_config(24);
  PlanInputs in;
  in.memory.max_micro_batch = 1000;
  in.memory.budget_bytes = int64_t{72} << 30;
  in.memory.throughput = {{16, 5000.0}};
  in.memory.throughput_choice = 16;
  const Plan p = make_plan(c, gpu_profile(8), in);
  CHECK(p.micro_batch == 24);
  CHECK(p.accum_steps == 1);
  CHECK_THAT(p.to_text(), !Catch::Contains("gained < 5%"));

  // Scale mode: the largest size timed, 1024 of 3000 that fit, is no throughput limit either.
  c.tuning.batch = "scale";
  in.memory.max_micro_batch = 3000;
  in.memory.throughput = {{16, 100.0}, {256, 1600.0}, {1024, 6000.0}};
  in.memory.throughput_choice = 1024;
  c.tuning.max_global_batch = 1 << 20;
  const Plan s = make_plan(c, gpu_profile(8), in);
  CHECK(s.micro_batch == 2048);
  CHECK_THAT(s.to_text(), Catch::Contains("memory fits 3000") && !Catch::Contains("gained < 5%"));
}

TEST_CASE("plan: when not even one sample fits the budget the plan takes micro-batch 1 and warns", "[plan]") {
  Config c = base_config(128);
  PlanInputs in;
  in.memory.fixed_bytes = int64_t{1} << 30;  // the fixed cost alone is over the budget
  in.memory.per_sample_bytes = 8.0 * (1 << 20);
  in.memory.budget_bytes = int64_t{160} << 20;
  in.memory.max_micro_batch = 0;
  in.memory.estimate = true;
  in.memory.source = "probe on cpu at 2, 4, converted to fp16 on Tesla T4";
  const Plan p = make_plan(c, gpu_profile(7), in);
  CHECK(p.micro_batch == 1);
  CHECK(p.accum_steps == 128);
  CHECK(p.global_batch == 128);
  CHECK_THAT(p.to_text(), Catch::Contains("WARNING: not even one sample fits") &&
                              Catch::Contains("tuning.memory_fraction") && !Catch::Contains("whole per-rank batch"));
  // A fixed micro-batch is kept, with the same warning.
  c.tuning.micro_batch = 8;
  CHECK_THAT(make_plan(c, gpu_profile(7), in).to_text(), Catch::Contains("WARNING: not even one sample fits"));
  // Scale mode cannot grow, and says why.
  c.tuning.micro_batch = 0;
  c.tuning.batch = "scale";
  const Plan s = make_plan(c, gpu_profile(7), in);
  CHECK(s.global_batch == 128);
  CHECK(s.micro_batch == 1);
  CHECK_THAT(s.to_text(), Catch::Contains("not even one sample fits") && !Catch::Contains("no memory measurement"));
}

TEST_CASE("plan: a cached measurement is re-sized to the memory free now", "[plan]") {
  MemoryEvidence cached;
  cached.fixed_bytes = int64_t{2} << 30;
  cached.per_sample_bytes = 64.0 * (1 << 20);   // 16 samples per GiB
  cached.budget_bytes = int64_t{66} << 30;      // 64 GiB of samples: 1024 fit
  cached.max_micro_batch = 1000;                // trial found 1000 the limit
  cached.source = "probe on cuda:0 at 8, 16, 32";
  // As much or more free: unchanged, since sizes above 1000 were never confirmed.
  for (int64_t gib : {66, 70}) {
    const MemoryEvidence same = with_current_budget(cached, gib << 30);
    CHECK(same.max_micro_batch == 1000);
    CHECK(same.budget_bytes == cached.budget_bytes);
    CHECK(same.source == cached.source);
  }
  // Slightly less, still room for 1000: the budget is updated and nothing else.
  const MemoryEvidence close = with_current_budget(cached, int64_t{65} << 30);
  CHECK(close.max_micro_batch == 1000);
  CHECK(close.budget_bytes == int64_t{65} << 30);
  CHECK(close.source == cached.source);
  // Another process holds 40 GiB: 24 GiB of samples fit, 384.
  const MemoryEvidence busy = with_current_budget(cached, int64_t{26} << 30);
  CHECK(busy.max_micro_batch == 384);
  CHECK_THAT(busy.source, Catch::Contains("26 GiB budget now, 66 GiB when measured: largest micro-batch 384, was 1000"));
  // Not even the fixed cost fits any more: the plan's nothing-fits warning takes over.
  CHECK(with_current_budget(cached, int64_t{1} << 30).max_micro_batch == 0);
  Config c = base_config(256);
  PlanInputs in;
  in.memory = with_current_budget(cached, int64_t{1} << 30);
  CHECK_THAT(make_plan(c, gpu_profile(8), in).to_text(), Catch::Contains("WARNING: not even one sample fits"));
  // No budget recorded (the micro-batch was fixed): nothing to re-size.
  MemoryEvidence none;
  CHECK(with_current_budget(none, int64_t{1} << 30).max_micro_batch == 0);
  CHECK(with_current_budget(none, int64_t{1} << 30).budget_bytes == 0);
}

TEST_CASE("plan: scale mode grows the global batch and scales the LR", "[plan]") {
  Config c = base_config(256);
  c.tuning.batch = "scale";
  c.optim.lr = 0.1;
  PlanInputs in;
  in.memory.max_micro_batch = 1500;  // -> power of two 1024
  Plan p = make_plan(c, gpu_profile(8), in);
  CHECK(p.scaled_batch);
  CHECK(p.global_batch == 1024);
  CHECK(p.micro_batch == 1024);
  CHECK(p.accum_steps == 1);
  CHECK(p.lr == Approx(0.4));  // linear: 0.1 x 1024 / 256

  c.tuning.lr_scaling = "sqrt";
  CHECK(make_plan(c, gpu_profile(8), in).lr == Approx(0.2));
  c.tuning.lr_scaling = "none";
  CHECK(make_plan(c, gpu_profile(8), in).lr == Approx(0.1));

  c.tuning.lr_scaling = "linear";
  c.tuning.max_global_batch = 512;
  const Plan capped = make_plan(c, gpu_profile(8), in);
  CHECK(capped.global_batch == 512);
  CHECK_THAT(capped.to_text(), Catch::Contains("tuning.max_global_batch 512"));
  // The reason names the limit that stopped the growth, not the memory.
  c.tuning.max_global_batch = 0;
  c.tuning.max_micro_batch = 64;
  const Plan micro_capped = make_plan(c, gpu_profile(8), in);
  CHECK(micro_capped.global_batch == 256);
  CHECK_THAT(micro_capped.to_text(),
             Catch::Contains("tuning.max_micro_batch 64") && !Catch::Contains("memory allows no more"));
  c.tuning.max_micro_batch = 0;

  // Gradual warmup when the LR was scaled up and none is configured.
  c.tuning.max_global_batch = 0;
  p = make_plan(c, gpu_profile(8), in);
  finalize_schedule(p, c, 1024 * 100);  // 100 steps/epoch, 2 epochs
  CHECK(p.warmup_steps == 20);          // min(5 epochs, 10% of 200)

  // Without a memory measurement, scale mode keeps the configured batch.
  const Plan cpu = make_plan(c, cpu_profile(), {});
  CHECK_FALSE(cpu.scaled_batch);
  CHECK(cpu.global_batch == 256);
  CHECK(cpu.lr == Approx(0.1));

  // Fixed mode never changes the global batch, whatever the memory.
  c.tuning.batch = "fixed";
  CHECK(make_plan(c, gpu_profile(8), in).global_batch == 256);
}

TEST_CASE("the BLAS LibTorch calls on CPU is an optimized one, and reported", "[device]") {
  const DeviceProfile cpu = detect_device("cpu");
  INFO("BLAS: " << cpu.blas);
  CHECK_FALSE(cpu.blas.empty());
  // Debian's reference BLAS (~40x slower) lives in .../blas/libblas.so.3; scripts/setup selects OpenBLAS.
  CHECK(cpu.blas.find("/blas/libblas.so") == std::string::npos);
  CHECK((cpu.blas.find("openblas") != std::string::npos || cpu.blas.find("mkl") != std::string::npos));
}

TEST_CASE("plan: a per-rank batch without a divisor near the cap warns and names batches that split well", "[plan]") {
  auto micro_reason = [](const Plan& p) {
    for (const auto& d : p.decisions) {
      if (d.name == "micro_batch") return d.text();
    }
    return std::string();
  };
  SECTION("331 is prime: 331 passes of 1, not silently") {
    Config c = base_config(331);
    c.tuning.max_micro_batch = 128;
    const Plan p = make_plan(c, cpu_profile(), {});
    CHECK(p.global_batch == 331);  // kept exact: changing it would change the optimisation
    CHECK(p.micro_batch == 1);
    CHECK(p.accum_steps == 331);
    CHECK_THAT(micro_reason(p), Catch::Contains("WARNING: the per-rank batch 331 has no divisor from 64 to 128, so "
                                                "each step runs 331 passes of micro-batch 1"));
    CHECK_THAT(micro_reason(p), Catch::Contains("330 (micro-batch 110 x accum 3) and 332 (micro-batch 83 x accum 4)"));
    // A warning of its own, not text inside the reason: the JSON carries it as one, and only the
    // decision it belongs to has one.
    size_t with_warnings = 0;
    for (const auto& d : p.decisions) {
      if (d.warnings.empty()) continue;
      ++with_warnings;
      CHECK(d.name == "micro_batch");
      REQUIRE(d.warnings.size() == 1);
      CHECK_THAT(d.warnings[0], Catch::StartsWith("the per-rank batch 331 has no divisor"));
      CHECK_THAT(d.reason, !Catch::Contains("WARNING"));
    }
    CHECK(with_warnings == 1);
    CHECK_THAT(p.to_json(), Catch::Contains("\"warnings\":[\"the per-rank batch 331 has no divisor"));
    CHECK(p.to_json().find("\"warnings\"") == p.to_json().rfind("\"warnings\""));
  }
  SECTION("514 = 2 x 257 under a cap of 256: micro-batch 2") {
    Config c = base_config(514);
    c.tuning.max_micro_batch = 256;
    const Plan p = make_plan(c, cpu_profile(), {});
    CHECK(p.micro_batch == 2);
    CHECK_THAT(micro_reason(p), Catch::Contains("513 (micro-batch 171 x accum 3) and 516 (micro-batch 172 x accum 3)"));
  }
  SECTION("the suggestions are multiples of the world size") {
    Config c = base_config(662);
    c.tuning.max_micro_batch = 128;
    PlanInputs in;
    in.world_size = 2;
    const Plan p = make_plan(c, cpu_profile(), in);
    CHECK(p.micro_batch == 1);
    CHECK_THAT(micro_reason(p), Catch::Contains("660 (330 per rank: micro-batch 110 x accum 3) and 664 (332 per rank: "
                                                "micro-batch 83 x accum 4)"));
  }
  SECTION("a measured memory cap counts like tuning.max_micro_batch") {
    Config c = base_config(331);
    PlanInputs in;
    in.memory.max_micro_batch = 100;
    in.memory.budget_bytes = int64_t{1} << 30;
    in.memory.per_sample_bytes = 1e6;
    const Plan p = make_plan(c, gpu_profile(8), in);
    CHECK(p.micro_batch == 1);
    CHECK_THAT(micro_reason(p), Catch::Contains("no divisor from 50 to 100"));
  }
  SECTION("no warning when a divisor of at least half the cap exists, or nothing caps the batch") {
    Config c = base_config(96);
    c.tuning.max_micro_batch = 40;  // 32
    CHECK_THAT(micro_reason(make_plan(c, cpu_profile(), {})), !Catch::Contains("WARNING"));
    CHECK_THAT(micro_reason(make_plan(base_config(331), cpu_profile(), {})), !Catch::Contains("WARNING"));
  }
}

TEST_CASE("plan: cudnn.benchmark stays off for data whose shapes vary, and the reason says why", "[plan]") {
  const Config c = base_config(64);
  PlanInputs in;
  CHECK(make_plan(c, gpu_profile(8), in).cudnn_benchmark);
  in.static_shapes = false;
  in.varying_shapes = "tsv: train.tsv, 3 texts";
  const Plan p = make_plan(c, gpu_profile(8), in);
  CHECK_FALSE(p.cudnn_benchmark);
  bool found = false;
  for (const auto& d : p.decisions) {
    if (d.name != "cudnn_benchmark") continue;
    found = true;
    CHECK(d.value == "off");
    CHECK_THAT(d.reason, Catch::StartsWith("input shapes vary from batch to batch (tsv: train.tsv, 3 texts)"));
  }
  CHECK(found);
}

TEST_CASE("plan: without the data the schedule is unknown, not 0", "[plan]") {
  Config c = base_config(64);
  c.trainer.epochs = 90;
  c.schedule.warmup_epochs = 5;
  Plan p = make_plan(c, cpu_profile(), {});
  defer_schedule(p, c);
  CHECK_FALSE(p.schedule_known);
  const std::string json = p.to_json();
  CHECK_THAT(json, Catch::Contains("\"warmup_steps\":null"));
  CHECK_THAT(json, Catch::Contains("\"warmup_epochs\":5"));
  CHECK_THAT(json, Catch::Contains("\"total_steps\":null"));
  CHECK_THAT(json, Catch::Contains("\"steps_per_epoch\":null"));
  const std::string text = p.to_text();
  CHECK_THAT(text, Catch::Matches("[\\s\\S]*warmup_steps +5 epochs +[^\\n]*resolved when the data is read[\\s\\S]*"));
  CHECK_THAT(text, Catch::Matches("[\\s\\S]*total_steps +90 epochs +[^\\n]*resolved when the data is read[\\s\\S]*"));

  c.schedule.warmup_epochs = 0;
  c.schedule.warmup_steps = 100;
  c.trainer.epochs = 0;
  c.trainer.max_steps = 1000;
  Plan q = make_plan(c, cpu_profile(), {});
  defer_schedule(q, c);
  CHECK_THAT(q.to_text(), Catch::Matches("[\\s\\S]*total_steps +1000 +trainer.max_steps\\n[\\s\\S]*"));
  CHECK_THAT(q.to_text(), Catch::Matches("[\\s\\S]*warmup_steps +100 +schedule.warmup_steps[\\s\\S]*"));
  // trainer.max_steps alone fixes the run's length, and a warmup in steps with it: numbers in
  // the JSON; the epoch length still needs the data.
  CHECK(q.total_steps == 1000);
  CHECK(q.warmup_steps == 100);
  CHECK_FALSE(q.schedule_known);
  CHECK_THAT(q.to_json(), Catch::Contains("\"total_steps\":1000"));
  CHECK_THAT(q.to_json(), Catch::Contains("\"warmup_steps\":100"));
  CHECK_THAT(q.to_json(), Catch::Contains("\"steps_per_epoch\":null"));
  c.schedule.warmup_steps = 5000;  // longer than the run: capped, and said so
  Plan capped = make_plan(c, cpu_profile(), {});
  defer_schedule(capped, c);
  CHECK_THAT(capped.to_json(), Catch::Contains("\"warmup_steps\":1000"));
  CHECK_THAT(capped.to_text(), Catch::Contains("capped by the run's length"));
  c.schedule.warmup_steps = 100;
  // With epochs too, either may end the run first: unknown.
  c.trainer.epochs = 3;
  Plan both = make_plan(c, cpu_profile(), {});
  defer_schedule(both, c);
  CHECK_THAT(both.to_json(), Catch::Contains("\"total_steps\":null"));
  CHECK_THAT(both.to_json(), Catch::Contains("\"warmup_steps\":null"));
  c.trainer.epochs = 0;

  // Once the data is read, numbers.
  Plan r = make_plan(c, cpu_profile(), {});
  finalize_schedule(r, c, 6400);
  CHECK(r.schedule_known);
  CHECK_THAT(r.to_json(), Catch::Contains("\"warmup_steps\":100"));
  CHECK_THAT(r.to_json(), Catch::Contains("\"total_steps\":1000"));
}

TEST_CASE("plan: scale mode with a fixed micro-batch names tuning.micro_batch as the reason", "[plan]") {
  Config c = base_config(256);
  c.tuning.batch = "scale";
  c.tuning.micro_batch = 64;
  const Plan p = make_plan(c, gpu_profile(8), {});
  CHECK(p.global_batch == 256);
  REQUIRE(p.decisions.size() > 1);
  CHECK(p.decisions[1].name == "global_batch");
  CHECK(p.decisions[1].reason ==
        "tuning.batch scale, but tuning.micro_batch 64 fixes the micro-batch (and nothing is measured): "
        "trainer.global_batch");
}

// TRAIN_TEST_WORKER=host_malloc: a fresh process calls tune_host_malloc(), then repeats what a
// training step does to the heap (blocks of 20 MiB and 1 MiB, written, freed) and prints whether
// the setting applied, the page faults of the last repetition and the reason.
int host_malloc_test_worker() {
  const bool tuned = tune_host_malloc();
  const auto faults = [] {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return static_cast<long>(usage.ru_minflt);
  };
  long last = 0;
  for (int round = 0; round < 4; ++round) {
    const long before = faults();
    std::vector<void*> blocks;
    for (int i = 0; i < 48; ++i) {
      const size_t size = i < 8 ? size_t{20} << 20 : size_t{1} << 20;
      void* block = std::malloc(size);
      if (block == nullptr) return 3;
      std::memset(block, 1, size);
      blocks.push_back(block);
    }
    for (void* block : blocks) std::free(block);
    last = faults() - before;
  }
  std::printf("tuned=%d faults=%ld reason=%s\n", tuned ? 1 : 0, last, host_malloc_state().reason.c_str());
  return 0;
}

TEST_CASE("tune_host_malloc keeps a step's freed memory in the process, unless the environment tunes malloc",
          "[plan][process]") {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  WARN("skipped: the sanitizer's allocator replaces glibc's malloc");
#else
  char self[4096] = {};
  REQUIRE(::readlink("/proc/self/exe", self, sizeof self - 1) > 0);
  const auto run = [&](const std::string& environment) {
    const std::string command = "env " + environment + " TRAIN_TEST_WORKER=host_malloc '" + self + "'";
    FILE* out = ::popen(command.c_str(), "r");
    REQUIRE(out != nullptr);
    std::string text;
    char buffer[512];
    while (std::fgets(buffer, sizeof buffer, out) != nullptr) text += buffer;
    CHECK(::pclose(out) == 0);
    return text;
  };
  const auto faults_in = [](const std::string& text) {
    const size_t at = text.find("faults=");
    return at == std::string::npos ? -1L : std::atol(text.c_str() + at + 7);
  };
  const std::string kept = run("-u TRAIN_HOST_MALLOC -u MALLOC_ARENA_MAX -u GLIBC_TUNABLES -u LD_PRELOAD");
  const std::string plain = run("TRAIN_HOST_MALLOC=default");
  CAPTURE(kept, plain);
  CHECK_THAT(kept, Catch::Contains("tuned=1") && Catch::Contains("freed memory stays in the process"));
  CHECK_THAT(plain, Catch::Contains("tuned=0") && Catch::Contains("TRAIN_HOST_MALLOC=default"));
  // 160 MiB of 20 MiB blocks come back from the kernel zero-filled every time under glibc's
  // defaults (about 41,000 faults); kept, they are reused.
  CHECK(faults_in(plain) > 20000);
  CHECK(faults_in(kept) >= 0);
  CHECK(faults_in(kept) < faults_in(plain) / 20);
  // A value other than 'default' is said to be ignored.
  CHECK_THAT(run("-u MALLOC_ARENA_MAX -u GLIBC_TUNABLES -u LD_PRELOAD TRAIN_HOST_MALLOC=off"),
             Catch::Contains("tuned=1") && Catch::Contains("TRAIN_HOST_MALLOC=off ignored"));
  // Another malloc setting in the environment wins.
  CHECK_THAT(run("MALLOC_TOP_PAD_=4096"), Catch::Contains("tuned=0") && Catch::Contains("MALLOC_TOP_PAD_ is set"));
#endif
}

TEST_CASE("plan: host_malloc says what the process's heap does with freed memory", "[plan]") {
  const Plan p = make_plan(base_config(64), cpu_profile(), {});
  const HostMallocState state = host_malloc_state();
  CHECK(p.host_malloc_kept == state.tuned);
  CHECK_THAT(p.to_text(), Catch::Contains("host_malloc") && Catch::Contains(state.reason));
  CHECK_THAT(p.to_json(), Catch::Contains(std::string("\"host_malloc_kept\":") + (state.tuned ? "true" : "false")));
}

TEST_CASE("plan: cuda_graphs only where a captured step can replay and the reason says why", "[plan]") {
  auto decision = [](const Plan& p) {
    for (const auto& d : p.decisions) {
      if (d.name == "cuda_graphs") return d;
    }
    FAIL("no cuda_graphs decision");
    return PlanDecision{};
  };
  Config c = base_config(256);
  c.optim.name = "sgd";
  c.tuning.micro_batch = 256;
  PlanInputs in;
  in.capturable = true;
  in.convolutional = true;
  const bool fused_sgd = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3);
  if (!fused_sgd) {
    const Plan p = make_plan(c, gpu_profile(8), in);
    CHECK_FALSE(p.cuda_graphs);
    CHECK_THAT(decision(p).reason, Catch::Contains("no fused SGD kernel"));
    return;
  }
  SECTION("a capturable model with fused SGD on one GPU: on, and the plan says it is measured") {
    const Plan p = make_plan(c, gpu_profile(8), in);
    CHECK(p.cuda_graphs);
    CHECK(decision(p).value == "on");
    CHECK_THAT(decision(p).reason, Catch::Contains("kept only if a replay measures faster"));
    c.optim.clip_grad_norm = 1.0;  // clipped on the device, inside the graph
    CHECK(make_plan(c, gpu_profile(8), in).cuda_graphs);
    c.optim.clip_grad_norm = 0;
    CHECK_THAT(p.to_json(), Catch::Contains("\"cuda_graphs\":true"));
    c.tuning.cuda_graphs = "on";
    CHECK_THAT(decision(make_plan(c, gpu_profile(8), in)).reason, Catch::Contains("kept (tuning.cuda_graphs on)"));
  }
  SECTION("fused AdamW too, from LibTorch 2.4 (its learning rate and step count on the GPU)") {
    c.optim.name = "adamw";
    const Plan p = make_plan(c, gpu_profile(9), in);
    const bool device_adamw = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);
    CHECK(p.cuda_graphs == device_adamw);
    CHECK_THAT(decision(p).reason, Catch::Contains(device_adamw ? "fused adamw: the step is captured" : "2.4 or later"));
  }
  SECTION("the same config on a CPU: off, without a warning") {
    c.tuning.cuda_graphs = "on";
    const Plan p = make_plan(c, cpu_profile(), in);
    CHECK_FALSE(p.cuda_graphs);
    CHECK(decision(p).reason == "CPU run");
    CHECK(decision(p).warnings.empty());
  }
  SECTION("each blocker turns it off and is named; with tuning.cuda_graphs on as a warning") {
    struct Case {
      const char* what;
      std::function<void(Config&, PlanInputs&)> change;
      const char* reason;
    };
    const std::vector<Case> cases = {
        {"off", [](Config& k, PlanInputs&) { k.tuning.cuda_graphs = "off"; }, "tuning.cuda_graphs"},
        {"two ranks", [](Config& k, PlanInputs& i) { i.world_size = 2; k.tuning.micro_batch = 128; }, "data-parallel"},
        {"accumulation", [](Config& k, PlanInputs&) { k.tuning.micro_batch = 64; }, "gradient accumulation (4 micro-batches"},
        {"varying shapes", [](Config&, PlanInputs& i) { i.static_shapes = false; }, "input shapes vary"},
        {"a model that may sync", [](Config&, PlanInputs& i) { i.capturable = false; }, "Model::capturable"},
        {"foreach", [](Config& k, PlanInputs&) { k.optim.impl = "foreach"; }, "optim.impl foreach"},
        {"adamw loop", [](Config& k, PlanInputs&) { k.optim.name = "adamw"; k.optim.impl = "loop"; },
         "optim.impl loop; the captured step needs the fused adamw kernel"},
        {"fp16 loss scaling", [](Config& k, PlanInputs&) { k.precision.mode = "fp16"; }, "fp16 loss scaling"},
    };
    for (const auto& test : cases) {
      for (const std::string mode : {"auto", "on"}) {
        INFO(test.what << ", tuning.cuda_graphs " << mode);
        Config k = c;
        PlanInputs i = in;
        k.tuning.cuda_graphs = mode;
        test.change(k, i);
        const Plan p = make_plan(k, gpu_profile(8), i);
        CHECK_FALSE(p.cuda_graphs);
        CHECK(decision(p).value == "off");
        CHECK_THAT(decision(p).reason, Catch::Contains(test.reason));
        const bool warned = k.tuning.cuda_graphs == "on";
        REQUIRE(decision(p).warnings.size() == (warned ? 1u : 0u));
        if (warned) CHECK_THAT(decision(p).warnings[0], Catch::Contains("cannot be captured: " + decision(p).reason));
      }
    }
  }
  SECTION("a T4 (compute capability 7.5) plans fp16 with loss scaling: off") {
    const Plan p = make_plan(c, gpu_profile(7), in);
    CHECK(p.loss_scaling);
    CHECK_FALSE(p.cuda_graphs);
  }
}
