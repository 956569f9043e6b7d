// Config schema: parsing, validation messages (file:line:col + key path), overrides, to_yaml
// round-trips and the generated reference.
#include "testing.h"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <unistd.h>
#include <tuple>
#include <vector>

#include "train/config.h"
#include "train/errors.h"
#include "train/files.h"

using Catch::Matchers::Contains;
using train::Config;
using train::ConfigError;
using train::parse_config;

namespace {

// The required keys, one section per line. Tests put the YAML under test above this so that
// its line numbers are easy to read off.
const std::string kRequired =
    "model: {name: resnet18}\n"
    "data: {root: /data/mnist}\n"
    "trainer: {global_batch: 128, epochs: 2}\n";
// The required keys outside the trainer / data section, for tests of that section: the trainer
// section under test follows kModelAndData, the data section precedes kModelAndTrainer.
const std::string kModelAndData = "model: {name: m}\ndata: {root: /d}\n";
const std::string kModelAndTrainer = "model: {name: m}\ntrainer: {global_batch: 1, epochs: 1}\n";

// The message of the ConfigError that parsing `yaml` (as "test.yaml") throws.
std::string config_error(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(yaml, "test.yaml", overrides);
  } catch (const ConfigError& e) {
    CHECK(e.exit_code() == train::kExitInvalid);
    return e.what();
  }
  FAIL("expected a ConfigError for:\n" << yaml);
  return "";
}

// Every field of every section, for whole-config comparisons.
auto fields(const train::ModelConfig& m) {
  return std::tie(m.name, m.num_classes, m.in_channels, m.width, m.small_input, m.init_from, m.options);
}
auto fields(const train::DataConfig& d) {
  return std::tie(d.kind, d.root, d.train_images, d.train_labels, d.val_images, d.val_labels,
                  d.train_dir, d.val_dir, d.image_size, d.resize_size, d.crop_min_scale,
                  d.channels, d.synthetic_train_samples, d.synthetic_val_samples, d.mean, d.std,
                  d.random_crop, d.crop_padding, d.random_flip, d.shuffle, d.drop_last, d.workers,
                  d.prefetch);
}
auto fields(const train::OptimConfig& o) {
  return std::tie(o.name, o.lr, o.momentum, o.nesterov, o.weight_decay, o.beta1, o.beta2, o.eps,
                  o.decay_norm_and_bias, o.clip_grad_norm, o.impl);
}
auto fields(const train::ScheduleConfig& s) {
  return std::tie(s.name, s.warmup_steps, s.warmup_epochs, s.min_lr_ratio, s.milestones, s.gamma);
}
auto fields(const train::LossConfig& l) { return std::tie(l.label_smoothing); }
auto fields(const train::TrainerConfig& t) {
  return std::tie(t.epochs, t.max_steps, t.global_batch, t.eval_every_steps, t.eval_batch, t.seed,
                  t.device, t.threads);
}
auto fields(const train::TuningConfig& t) {
  return std::tie(t.device, t.batch, t.lr_scaling, t.base_batch, t.max_global_batch, t.micro_batch,
                  t.max_micro_batch, t.probe, t.memory_fraction, t.cache_dir);
}
auto fields(const train::PrecisionConfig& p) { return std::tie(p.mode, p.loss_scaling, p.channels_last); }
auto fields(const train::CheckpointConfig& c) { return std::tie(c.every_steps, c.keep_last, c.best, c.async); }
auto fields(const train::LoggingConfig& l) { return std::tie(l.every_steps, l.level, l.jsonl); }

void check_same(const Config& a, const Config& b) {
  CHECK(fields(a.model) == fields(b.model));
  CHECK(fields(a.data) == fields(b.data));
  CHECK(fields(a.optim) == fields(b.optim));
  CHECK(fields(a.schedule) == fields(b.schedule));
  CHECK(fields(a.loss) == fields(b.loss));
  CHECK(fields(a.trainer) == fields(b.trainer));
  CHECK(fields(a.tuning) == fields(b.tuning));
  CHECK(fields(a.precision) == fields(b.precision));
  CHECK(fields(a.checkpoint) == fields(b.checkpoint));
  CHECK(fields(a.logging) == fields(b.logging));
}

// A valid config in which every field differs from its default, with awkward floats and
// strings that need quoting in YAML.
Config unusual_config() {
  Config c;
  c.model.name = "resnet50";
  c.model.num_classes = 1000;
  c.model.in_channels = 1;
  c.model.width = 0.5;
  c.model.small_input = true;
  c.model.init_from = "null";  // a string, so it must be quoted
  c.model.options = train::ModelOptions(
      {{"hidden", "256"}, {"act-fn", "gelu: fast"}, {"flag", "on"}, {"empty", ""}, {"note", "# not a comment"}});
  c.data.kind = "idx";
  c.data.root = "/data/with: colon # and hash";
  c.data.train_images = "";
  c.data.train_labels = "it's \"quoted\"";
  c.data.val_images = "  leading space";
  c.data.val_labels = "two\nlines";
  c.data.train_dir = "ILSVRC/Data/CLS-LOC/train";
  c.data.val_dir = "val: sorted";
  c.data.image_size = 32;
  c.data.resize_size = 36;
  c.data.crop_min_scale = 0.35;
  c.data.channels = 3;
  c.data.synthetic_train_samples = 7;
  c.data.synthetic_val_samples = 5;
  c.data.mean = {0.1 + 0.2, 1.0 / 3.0, 0.0};
  c.data.std = {1e-8, 2.5, 1e300};
  c.data.random_crop = true;
  c.data.crop_padding = 4;
  c.data.random_flip = true;
  c.data.shuffle = false;
  c.data.workers = 3;
  c.data.prefetch = 1;
  c.optim.name = "adamw";
  c.optim.lr = 0.1 + 0.2;  // 0.30000000000000004
  c.optim.momentum = 0.1;
  c.optim.nesterov = true;
  c.optim.weight_decay = 5e-4;
  c.optim.beta1 = 0.85;
  c.optim.beta2 = 0.98;
  c.optim.eps = 3e-9;
  c.optim.decay_norm_and_bias = true;
  c.optim.clip_grad_norm = 1.0;
  c.optim.impl = "foreach";
  c.schedule.name = "step";
  c.schedule.warmup_steps = 100;
  c.schedule.warmup_epochs = 1.5;
  c.schedule.min_lr_ratio = 0.01;
  c.schedule.milestones = {0.5, 0.75};
  c.schedule.gamma = 0.2;
  c.loss.label_smoothing = 0.1;
  c.trainer.epochs = 3;
  c.trainer.max_steps = 1000;
  c.trainer.global_batch = 256;
  c.trainer.eval_every_steps = 25;
  c.trainer.eval_batch = 512;
  c.trainer.seed = 42;
  c.trainer.device = "cuda:1";
  c.trainer.threads = 4;
  c.tuning.device = "a100-80gb";
  c.tuning.batch = "scale";
  c.tuning.lr_scaling = "sqrt";
  c.tuning.base_batch = 256;
  c.tuning.max_global_batch = 4096;
  c.tuning.probe = false;
  c.tuning.memory_fraction = 0.85;
  c.tuning.cache_dir = "/tmp/plan cache";
  c.tuning.micro_batch = 64;
  c.tuning.max_micro_batch = 128;
  c.precision.mode = "bf16";
  c.precision.loss_scaling = "dynamic";
  c.precision.channels_last = "off";
  c.checkpoint.every_steps = 500;
  c.checkpoint.keep_last = 3;
  c.checkpoint.best = "loss";
  c.checkpoint.async = "on";
  c.logging.every_steps = 10;
  c.logging.level = "debug";
  c.logging.jsonl = false;
  return c;
}

std::string temp_path(const std::string& name) {
  return train::files::join("/tmp", name + "_" + std::to_string(::getpid()));
}

}  // namespace

TEST_CASE("a full config parses into typed fields", "[config]") {
  const Config c = parse_config(R"(# a full config
model:
  name: resnet18
  num_classes: 100
  width: 0.5
  small_input: yes
data:
  kind: synthetic
  image_size: 32
  channels: 3
  mean: [0.5, 0.25, 0.125]
  std:
    - 0.5
    - 0.5
    - 0.5
  random_flip: true
optim:
  name: adamw
  lr: 3e-4
  weight_decay: 0.05
schedule:
  name: step
  milestones: [0.5, 0.75]
loss:
  label_smoothing: 0.1
trainer:
  global_batch: 256
  max_steps: 500
  device: cuda:0
  seed: 7
tuning:
  micro_batch: 64
checkpoint:
  every_steps: 100
logging:
  level: debug
  jsonl: false
)",
                                "full.yaml");
  CHECK(c.source == "full.yaml");
  CHECK(c.model.name == "resnet18");
  CHECK(c.model.num_classes == 100);
  CHECK(c.model.width == 0.5);
  CHECK(c.model.small_input);
  CHECK(c.data.kind == "synthetic");
  CHECK(c.data.image_size == 32);
  CHECK(c.data.mean == std::vector<double>{0.5, 0.25, 0.125});
  CHECK(c.data.std == std::vector<double>{0.5, 0.5, 0.5});
  CHECK(c.data.random_flip);
  CHECK(c.optim.name == "adamw");
  CHECK(c.optim.lr == 3e-4);
  CHECK(c.optim.weight_decay == 0.05);
  CHECK(c.schedule.name == "step");
  CHECK(c.schedule.milestones == std::vector<double>{0.5, 0.75});
  CHECK(c.loss.label_smoothing == 0.1);
  CHECK(c.trainer.global_batch == 256);
  CHECK(c.trainer.max_steps == 500);
  CHECK(c.trainer.epochs == 0);
  CHECK(c.trainer.device == "cuda:0");
  CHECK(c.trainer.seed == 7);
  CHECK(c.tuning.micro_batch == 64);
  CHECK(c.checkpoint.every_steps == 100);
  CHECK(c.logging.level == "debug");
  CHECK_FALSE(c.logging.jsonl);
}

TEST_CASE("keys that are not given keep the struct defaults", "[config]") {
  const Config c = parse_config(kRequired, "minimal.yaml");
  Config expected;
  expected.model.name = "resnet18";
  expected.data.root = "/data/mnist";
  expected.trainer.global_batch = 128;
  expected.trainer.epochs = 2;
  check_same(c, expected);
  CHECK(c.optim.lr == 0.1);
  CHECK(c.optim.eps == 1e-8);
  CHECK(c.data.kind == "idx");
  CHECK(c.trainer.device == "auto");

  SECTION("an empty section is allowed") {
    const Config with_empty = parse_config(kRequired + "optim:\n", "minimal.yaml");
    CHECK(with_empty.optim.name == "sgd");
  }
}

TEST_CASE("YAML syntax errors name the file, line and column", "[config]") {
  CHECK_THAT(config_error("model:\n  name: [resnet18\ntrainer: {}\n"),
             Contains("test.yaml:3:8: invalid YAML"));
  CHECK_THAT(config_error("optim:\n  lr: 0.1\n   bad indent: 1\n"),
             Contains("test.yaml:3:14: invalid YAML: illegal map value"));
}

TEST_CASE("an empty or comment-only file is rejected", "[config]") {
  CHECK_THAT(config_error(""), Contains("test.yaml: empty config"));
  CHECK_THAT(config_error("# nothing but a comment\n\n"), Contains("test.yaml: empty config"));
}

TEST_CASE("the document and each section must be maps", "[config]") {
  CHECK_THAT(config_error("just a string\n"),
             Contains("test.yaml:1:1: expected a map of sections") && Contains("'just a string'"));
  CHECK_THAT(config_error("- model\n- data\n"),
             Contains("test.yaml:1:1:") && Contains("got a list"));
  CHECK_THAT(config_error("optim: 5\n" + kRequired),
             Contains("test.yaml:1:8: key 'optim': expected a map of keys, got '5'"));
  CHECK_THAT(config_error("---\na: 1\n---\nb: 2\n"),
             Contains("expected one YAML document, found 2"));
}

TEST_CASE("unknown sections and keys are rejected with a suggestion", "[config]") {
  SECTION("misspelt section") {
    CHECK_THAT(config_error("optimm:\n  lr: 0.1\n" + kRequired),
               Contains("test.yaml:1:1: key 'optimm': unknown section; did you mean 'optim'?"));
  }
  SECTION("misspelt key") {
    CHECK_THAT(config_error("optim:\n  lrr: 0.1\n" + kRequired),
               Contains("test.yaml:2:3: key 'optim.lrr': unknown key; did you mean 'optim.lr'?"));
  }
  SECTION("key in the wrong section") {
    CHECK_THAT(config_error("loss:\n  lr: 0.1\n" + kRequired),
               Contains("test.yaml:2:3: key 'loss.lr': unknown key; did you mean 'optim.lr'?"));
  }
  SECTION("other tools' names for a key") {
    // Spelling alone would suggest tuning.batch (a mode, fixed or scale) for batch_size.
    CHECK_THAT(config_error("trainer:\n  batch_size: 64\n" + kRequired),
               Contains("test.yaml:2:3: key 'trainer.batch_size': unknown key; did you mean "
                        "'trainer.global_batch'? (the batch of one optimizer step, over all ranks)"));
    CHECK_THAT(config_error("optim:\n  learning_rate: 0.1\n" + kRequired),
               Contains("key 'optim.learning_rate': unknown key; did you mean 'optim.lr'?"));
    CHECK_THAT(config_error("data:\n  Num_Workers: 4\n" + kRequired),
               Contains("key 'data.Num_Workers': unknown key; did you mean 'data.workers'?"));
    CHECK_THAT(config_error(kRequired, {"trainer.gradient_accumulation_steps=4"}),
               Contains("unknown key; accumulation follows from trainer.global_batch"));
    CHECK_THAT(config_error(kRequired, {"data.pin_memory=true"}),
               Contains("unknown key; pinned memory is the plan's choice"));
    CHECK_THAT(config_error(kRequired, {"batch_size=64"}), Contains("did you mean 'trainer.global_batch'?"));
    CHECK_THAT(config_error(kRequired, {"trainer.max_epochs=3"}), Contains("did you mean 'trainer.epochs'?"));
  }
  SECTION("a flat config's key at the top level") {
    CHECK_THAT(config_error("lr: 0.1\n" + kRequired),
               Contains("test.yaml:1:1: key 'lr': unknown section; keys go under their section: did you "
                        "mean 'optim.lr', written optim: {lr: ...}?"));
    CHECK_THAT(config_error("batch_size: 64\n" + kRequired),
               Contains("did you mean 'trainer.global_batch', written trainer: {global_batch: ...}?"));
    CHECK_THAT(config_error("pin_memory: true\n" + kRequired),
               Contains("key 'pin_memory': unknown section; pinned memory is the plan's choice"));
  }
  SECTION("nothing close enough to suggest") {
    const std::string key_message = config_error("optim:\n  flux_capacitor: 1\n" + kRequired);
    CHECK_THAT(key_message, Contains("test.yaml:2:3: key 'optim.flux_capacitor': unknown key"));
    CHECK_THAT(key_message, !Contains("did you mean"));
    const std::string section_message = config_error("zzz: {}\n" + kRequired);
    CHECK_THAT(section_message,
               Contains("key 'zzz': unknown section; the sections are model, data"));
  }
}

TEST_CASE("values of the wrong type are rejected with the expected type", "[config]") {
  CHECK_THAT(config_error("optim:\n  lr: abc\n" + kRequired),
             Contains("test.yaml:2:7: key 'optim.lr': expected a float, got 'abc'"));
  CHECK_THAT(config_error("checkpoint:\n  every_steps: 1.5\n" + kRequired),
             Contains("test.yaml:2:16: key 'checkpoint.every_steps': expected an int, got '1.5'"));
  CHECK_THAT(
      config_error("data:\n  root: /d\n  shuffle: maybe\n" + kModelAndTrainer),
      Contains("test.yaml:3:12: key 'data.shuffle': expected a bool (true or false; also yes/no, on/off), got 'maybe'"));
  // yaml-cpp's single letters are not bools here (PyYAML does not take them either).
  CHECK_THAT(config_error("data:\n  root: /d\n  shuffle: n\n" + kModelAndTrainer),
             Contains("key 'data.shuffle': expected a bool"));
  CHECK(parse_config("data:\n  root: /d\n  shuffle: Off\n" + kModelAndTrainer, "test.yaml").data.shuffle == false);
  CHECK_THAT(config_error("optim:\n  lr: {value: 0.1}\n" + kRequired),
             Contains("test.yaml:2:7: key 'optim.lr': expected a float, got a map"));
  CHECK_THAT(config_error("optim:\n  name: [sgd]\n" + kRequired),
             Contains("test.yaml:2:9: key 'optim.name': expected a string, got a list"));
  CHECK_THAT(
      config_error("optim:\n  lr: \"0.1\"\n" + kRequired),
      Contains("test.yaml:2:7: key 'optim.lr': expected a float, got the quoted string \"0.1\""));
  CHECK_THAT(config_error("optim:\n  lr:\n" + kRequired),
             Contains("test.yaml:2:3: key 'optim.lr': expected a float, got no value"));
  CHECK_THAT(config_error("schedule:\n  milestones: 0.5\n" + kRequired),
             Contains("test.yaml:2:15: key 'schedule.milestones': expected a list of floats"));
  CHECK_THAT(config_error("schedule:\n  milestones: [0.5, x]\n" + kRequired),
             Contains("test.yaml:2:21: key 'schedule.milestones[1]': expected a float, got 'x'"));
  CHECK_THAT(config_error("optim:\n  lr: .nan\n" + kRequired),
             Contains("key 'optim.lr': expected a float"));
}

TEST_CASE("out-of-range values are rejected with the allowed range", "[config]") {
  CHECK_THAT(config_error("optim:\n  lr: -0.1\n" + kRequired),
             Contains("test.yaml:2:7: key 'optim.lr': must be > 0, got -0.1"));
  CHECK_THAT(config_error("optim:\n  momentum: 1.5\n" + kRequired),
             Contains("test.yaml:2:13: key 'optim.momentum': must be in [0, 1), got 1.5"));
  CHECK_THAT(config_error(kModelAndData + "trainer:\n  epochs: 1\n  global_batch: 0\n"),
             Contains("test.yaml:5:17: key 'trainer.global_batch': must be in [1, 16777216], got 0"));
  CHECK_THAT(
      config_error("data:\n  root: /d\n  mean: [0.5, 0.5]\n  std: [0.5, 0]\n" + kModelAndTrainer),
      Contains("test.yaml:4:14: key 'data.std[1]': must be > 0, got 0"));
  CHECK_THAT(config_error("schedule:\n  milestones: [0.5, 1.0]\n" + kRequired),
             Contains("test.yaml:2:21: key 'schedule.milestones[1]': must be in (0, 1), got 1.0"));
}

TEST_CASE("enum values must be one of the allowed values", "[config]") {
  CHECK_THAT(config_error("optim:\n  name: sdg\n" + kRequired),
             Contains("test.yaml:2:9: key 'optim.name': must be one of sgd, adamw, got 'sdg'; "
                      "did you mean 'sgd'?"));
  CHECK_THAT(
      config_error("logging:\n  level: verbose\n" + kRequired),
      Contains(
          "key 'logging.level': must be one of trace, debug, info, warn, error, got 'verbose'"));
}

TEST_CASE("duplicate keys and sections are rejected", "[config]") {
  CHECK_THAT(config_error("optim:\n  lr: 0.1\n  lr: 0.2\n" + kRequired),
             Contains("test.yaml:3:3: key 'optim.lr': duplicate key (first given at 2:3)"));
  CHECK_THAT(config_error("optim: {}\noptim: {}\n" + kRequired),
             Contains("test.yaml:2:1: key 'optim': duplicate key (first given at 1:1)"));
}

TEST_CASE("required keys must be given", "[config]") {
  CHECK_THAT(config_error("data: {root: /d}\ntrainer: {global_batch: 1, epochs: 1}\n"),
             Contains("test.yaml: key 'model.name': required key is missing"));
  CHECK_THAT(config_error(kModelAndData + "trainer: {epochs: 1}\n"),
             Contains("test.yaml: key 'trainer.global_batch': required key is missing"));
  CHECK_THAT(config_error(kModelAndData + "trainer: {global_batch: 8}\n"),
             Contains("test.yaml: key 'trainer.epochs': set trainer.epochs or trainer.max_steps"));
  CHECK_THAT(
      config_error(kModelAndData + "trainer: {global_batch: 8, max_steps: 0}\n"),
      Contains("test.yaml:3:39: key 'trainer.max_steps': set trainer.epochs or trainer.max_steps"));
  CHECK_THAT(config_error(
                 "model:\n  name: \"\"\ndata: {root: /d}\ntrainer: {global_batch: 8, epochs: 1}\n"),
             Contains("test.yaml:2:9: key 'model.name': must not be empty"));
}

TEST_CASE("rules across keys are checked", "[config]") {
  SECTION("mean and std have the same length") {
    CHECK_THAT(
        config_error("data:\n  root: /d\n  mean: [0.5, 0.5]\n  std: [0.5]\n" + kModelAndTrainer),
        Contains("test.yaml:4:8: key 'data.std': data.mean has 2 entries and data.std has 1"));
  }
  SECTION("idx needs a root") {
    CHECK_THAT(config_error(kModelAndTrainer),
               Contains("test.yaml: key 'data.root': required when data.kind is 'idx'"));
    CHECK_NOTHROW(parse_config("data: {kind: synthetic}\n" + kModelAndTrainer, "test.yaml"));
  }
  SECTION("drop_last false is refused, not ignored") {
    CHECK_THAT(config_error("data:\n  kind: synthetic\n  drop_last: false\n" + kModelAndTrainer),
               Contains("test.yaml:3:14: key 'data.drop_last': false is not supported: every optimizer step takes "
                        "exactly trainer.global_batch samples"));
    CHECK_NOTHROW(parse_config("data: {kind: synthetic, drop_last: true}\n" + kModelAndTrainer, "test.yaml"));
  }
  SECTION("nesterov needs momentum") {
    CHECK_THAT(config_error("optim:\n  name: sgd\n  momentum: 0\n  nesterov: true\n" + kRequired),
               Contains("test.yaml:4:13: key 'optim.nesterov': Nesterov momentum needs optim.momentum > 0"));
    CHECK_NOTHROW(parse_config("optim: {name: sgd, nesterov: true, momentum: 0.9}\n" + kRequired, "test.yaml"));
  }
  SECTION("milestones increase") {
    CHECK_THAT(config_error("schedule:\n  milestones: [0.6, 0.3]\n" + kRequired),
               Contains("test.yaml:2:15: key 'schedule.milestones': must be strictly increasing, "
                        "got 0.3 after 0.6"));
  }
  SECTION("micro_batch fits in global_batch") {
    CHECK_THAT(config_error("tuning:\n  micro_batch: 256\n" + kRequired),
               Contains("test.yaml:2:16: key 'tuning.micro_batch': is 256, larger than "
                        "trainer.global_batch (128)"));
    CHECK_NOTHROW(parse_config("tuning:\n  micro_batch: 128\n" + kRequired, "test.yaml"));
  }
  SECTION("device is auto, cpu, cuda or cuda:N") {
    CHECK_THAT(config_error(kModelAndData + "trainer: {global_batch: 1, epochs: 1, device: gpu}\n"),
               Contains("test.yaml:3:47: key 'trainer.device': must be auto, cpu, cuda or cuda:N"));
    CHECK_THAT(config_error(kRequired, {"trainer.device=cuda:x"}),
               Contains("key 'trainer.device'"));
    for (const std::string device : {"auto", "cpu", "cuda", "cuda:3"})
      CHECK(parse_config(kRequired, "test.yaml", {"trainer.device=" + device}).trainer.device ==
            device);
  }
}

TEST_CASE("overrides (--set) are typed, checked and applied after the file", "[config]") {
  SECTION("applied") {
    const Config c = parse_config(
        kRequired, "test.yaml",
        {"optim.lr=0.25", "data.mean=[0.5, 0.5]", "data.std=[0.25,0.25]", "trainer.device=cpu",
         "data.shuffle=false", "model.init_from=", "trainer.epochs=5", "trainer.epochs=6"});
    CHECK(c.optim.lr == 0.25);
    CHECK(c.data.mean == std::vector<double>{0.5, 0.5});
    CHECK(c.data.std == std::vector<double>{0.25, 0.25});
    CHECK(c.trainer.device == "cpu");
    CHECK_FALSE(c.data.shuffle);
    CHECK(c.model.init_from.empty());
    CHECK(c.trainer.epochs == 6);  // the last override wins
  }
  SECTION("a whole section is not a key") {
    CHECK_THROWS_WITH(parse_config(kRequired, "test.yaml", {"optim={lr: 0.5}"}),
                      Catch::Contains("--set optim={lr: 0.5}: key 'optim': a section, not a key; --set takes one key "
                                      "at a time, e.g. --set optim.name=..."));
  }
  SECTION("a NUL character in a string, from YAML's \\0 escape") {
    CHECK_THROWS_WITH(parse_config(kRequired + "tuning: {cache_dir: \"plans\\0junk\"}\n", "test.yaml"),
                      Catch::Contains("test.yaml:") && Catch::Contains("holds a NUL character"));
    CHECK_THROWS_WITH(parse_config(kRequired, "test.yaml", {"model.name=\"mlp\\0\""}),
                      Catch::Contains("key 'model.name'") && Catch::Contains("holds a NUL character"));
  }
  SECTION("they can supply a missing required key") {
    const Config c = parse_config(kModelAndData + "trainer: {epochs: 1}\n", "test.yaml",
                                  {"trainer.global_batch=64"});
    CHECK(c.trainer.global_batch == 64);
  }
  SECTION("cross-key rules see the overridden values") {
    CHECK_THAT(
        config_error(kRequired, {"tuning.micro_batch=512"}),
        Contains("--set tuning.micro_batch=512: key 'tuning.micro_batch': is 512, larger than"));
  }
  SECTION("rejected") {
    CHECK_THAT(config_error(kRequired, {"optim.lr=abc"}),
               Contains("--set optim.lr=abc: key 'optim.lr': expected a float, got 'abc'"));
    CHECK_THAT(config_error(kRequired, {"optim.lr=-1"}),
               Contains("--set optim.lr=-1: key 'optim.lr': must be > 0"));
    CHECK_THAT(
        config_error(kRequired, {"optim.lrr=0.1"}),
        Contains("--set optim.lrr=0.1: key 'optim.lrr': unknown key; did you mean 'optim.lr'?"));
    CHECK_THAT(config_error(kRequired, {"optimm.lr=0.1"}), Contains("did you mean 'optim.lr'?"));
    CHECK_THAT(config_error(kRequired, {"lr=0.1"}), Contains("did you mean 'optim.lr'?"));
    // A flat key names its section's key, not a path that looks alike.
    CHECK_THAT(config_error(kRequired, {"epochs=3"}), Contains("did you mean 'trainer.epochs'?"));
    CHECK_THAT(config_error(kRequired, {"global_batch=8"}), Contains("did you mean 'trainer.global_batch'?"));
    CHECK_THAT(config_error(kRequired, {"seed=3"}), Contains("did you mean 'trainer.seed'?"));
    // Case does not count in suggestions: FP16 is fp16, not bf16 one edit away.
    CHECK_THAT(config_error(kRequired, {"precision.mode=FP16"}), Contains("did you mean 'fp16'?"));
    CHECK_THAT(config_error(kRequired, {"optim.LR=0.1"}), Contains("did you mean 'optim.lr'?"));
    CHECK_THAT(config_error(kRequired, {"logging.level=INFO"}), Contains("did you mean 'info'?"));
    // One word of a key of the same section beats a short key of another one edit-distance away.
    CHECK_THAT(config_error(kRequired, {"trainer.steps=5"}), Contains("did you mean 'trainer.max_steps'?"));
    CHECK_THAT(config_error(kRequired, {"trainer.batch=64"}), Contains("did you mean 'trainer.global_batch'?"));
    CHECK_THAT(config_error(kRequired, {"schedule.warmup=5"}), Contains("did you mean 'schedule.warmup_steps'?"));
    // A comment would drop part of the value; quoted, '#' is text.
    CHECK_THAT(config_error(kRequired, {"data.root=/d #2"}),
               Contains("--set data.root=/d #2: key 'data.root': '#2' would be read as a YAML comment and dropped"));
    CHECK_THAT(config_error(kRequired, {"optim.lr"}),
               Contains("--set optim.lr: expected key=value"));
    CHECK_THAT(config_error(kRequired, {"=0.1"}), Contains("--set =0.1: empty key"));
    CHECK_THAT(config_error(kRequired, {"data.mean=[0.5,"}),
               Contains("--set data.mean=[0.5,: key 'data.mean': invalid YAML value"));
    CHECK_THAT(config_error(kRequired, {"data.mean=[0.5, x]"}),
               Contains("--set data.mean=[0.5, x]: key 'data.mean[1]': expected a float"));
  }
}

TEST_CASE("overrides (--set) take one whole value: trailing text, a bare comma and empty list items are errors",
          "[config]") {
  // Each of these used to be taken silently as its first part: [0.5], mlp, [], "".
  CHECK_THAT(config_error(kRequired, {"data.mean=[0.5] junk"}),
             Contains("--set data.mean=[0.5] junk: key 'data.mean': unexpected text after the value: 'junk'"));
  CHECK_THAT(config_error(kRequired, {"model.name='mlp' junk"}),
             Contains("--set model.name='mlp' junk: key 'model.name': unexpected text after the value: 'junk'"));
  CHECK_THAT(config_error(kRequired, {"optim.lr=0.1 ---"}), Contains("key 'optim.lr'"));
  CHECK_THAT(config_error(kRequired, {"data.mean=,"}),
             Contains("--set data.mean=,: key 'data.mean': invalid YAML value: unexpected ','"));
  CHECK_THAT(config_error(kRequired, {"data.root=,"}),
             Contains("--set data.root=,: key 'data.root': invalid YAML value: unexpected ','"));
  CHECK_THAT(config_error(kRequired, {"data.mean=[0.5,,0.5]"}),
             Contains("--set data.mean=[0.5,,0.5]: key 'data.mean[1]': expected a float, got no value"));
  CHECK_THAT(config_error(kRequired, {"data.mean=[,]"}), Contains("key 'data.mean[0]': expected a float"));
  // A YAML comment is not: in a shell it can only come quoted, so it is far more likely part of a
  // path ('data.root=/mnt/run #2') than a comment.
  CHECK_THAT(config_error(kRequired, {"optim.lr=0.5 # half"}), Contains("'# half' would be read as a YAML comment"));
  // Still fine: an empty value, a string with spaces, quoted text, '#' inside a word or quotes.
  const Config c = parse_config(kRequired, "test.yaml",
                                {"optim.lr=0.5", "model.init_from=", "data.root=/a b#1", "model.name='x #y'"});
  CHECK(c.optim.lr == 0.5);
  CHECK(c.model.init_from.empty());
  CHECK(c.data.root == "/a b#1");
  CHECK(c.model.name == "x #y");
}

TEST_CASE("size and count keys have upper bounds, so nothing downstream overflows", "[config]") {
  // Each of these got through the config before and then wrapped, divided by zero, allocated
  // without limit or went negative somewhere downstream.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"data.workers=4294967296", "key 'data.workers': must be in [-1, 1024]"},
      {"data.prefetch=4294967296", "key 'data.prefetch': must be in [1, 1024]"},
      {"data.prefetch=1000000000000", "key 'data.prefetch'"},
      {"trainer.epochs=9223372036854775807", "key 'trainer.epochs': must be in [0, 1000000]"},
      {"trainer.max_steps=9223372036854775807", "key 'trainer.max_steps': must be in [0, 68719476736]"},
      {"schedule.warmup_epochs=1e300", "key 'schedule.warmup_epochs'"},
      {"schedule.warmup_steps=9223372036854775807", "key 'schedule.warmup_steps'"},
      {"data.seq_len=9223372036854775807", "key 'data.seq_len': must be in [3, 1048576]"},
      {"distributed.init_timeout_s=1e300", "key 'distributed.init_timeout_s': must be in (0, 604800]"},
      {"distributed.timeout_s=1e300", "key 'distributed.timeout_s'"},
      {"trainer.stop_grace_s=1e300", "key 'trainer.stop_grace_s'"},
      {"distributed.bucket_mb=1e300", "key 'distributed.bucket_mb'"},
      {"trainer.threads=2147483648", "key 'trainer.threads': must be in [0, 4096]"},
      {"model.width=1e300", "key 'model.width': must be in (0, 64]"},
      {"data.image_size=3000000000", "key 'data.image_size': must be in [0, 16384]"},
      {"trainer.global_batch=4294967296", "key 'trainer.global_batch': must be in [1, 16777216]"},
      {"model.vocab_size=9223372036854775807", "key 'model.vocab_size'"},
      {"model.hidden_size=1000000", "key 'model.hidden_size'"},
      {"data.pad_id=99999999999", "key 'data.pad_id'"},
  };
  for (const auto& [set, expected] : cases) {
    INFO(set);
    CHECK_THAT(config_error(kRequired, {set}), Contains("--set " + set + ": " + expected));
  }
  // The bounds themselves are accepted.
  CHECK_NOTHROW(parse_config(kRequired, "test.yaml",
                             {"data.workers=1024", "data.prefetch=1024", "trainer.threads=4096",
                              "data.image_size=16384", "data.seq_len=1048576", "trainer.epochs=1000000",
                              "distributed.init_timeout_s=604800", "model.width=64"}));
}

TEST_CASE("trainer.device: cuda:N takes a device index, not any digit string", "[config]") {
  CHECK_THAT(config_error(kRequired, {"trainer.device=cuda:99999999999999999999"}),
             Contains("--set trainer.device=cuda:99999999999999999999: key 'trainer.device': device index "
                      "99999999999999999999 is out of range"));
  CHECK_THAT(config_error(kRequired, {"trainer.device=cuda:1024"}), Contains("key 'trainer.device'"));
  CHECK_THAT(config_error(kModelAndData + "trainer: {global_batch: 1, epochs: 1, device: 'cuda:2147483648'}\n"),
             Contains("test.yaml:3:47: key 'trainer.device'"));
  for (const std::string device : {"cuda:0", "cuda:7", "cuda:1023", "cuda:0007"})
    CHECK(parse_config(kRequired, "test.yaml", {"trainer.device=" + device}).trainer.device == device);
}

TEST_CASE("BERT sizes the model cannot build are config errors naming the key and its line", "[config]") {
  const std::string data_and_trainer =
      "data: {kind: tokens, root: /d}\ntrainer: {global_batch: 8, max_steps: 1}\n";
  // Heads that do not divide the hidden size (bert-tiny: H128 A2).
  CHECK_THAT(config_error("model:\n  name: bert-mlm\n  preset: bert-tiny\n  heads: 3\n" + data_and_trainer),
             Contains("test.yaml:4:10: key 'model.heads': 3 attention heads do not divide the hidden size 128 "
                      "(model.preset bert-tiny's)"));
  CHECK_THAT(config_error("model: {name: bert, preset: bert-tiny}\n" + data_and_trainer, {"model.heads=3"}),
             Contains("--set model.heads=3: key 'model.heads'"));
  // A hidden size that is not a multiple of the preset's heads (bert-base: A12).
  CHECK_THAT(config_error("model:\n  name: bert-classifier\n  hidden_size: 7\n" + data_and_trainer),
             Contains("test.yaml:3:16: key 'model.hidden_size': 7 is not a multiple of the 12 attention heads"));
  // Both given: the heads are named.
  CHECK_THAT(config_error("model: {name: bert-mlm, hidden_size: 100, heads: 8}\n" + data_and_trainer),
             Contains("key 'model.heads': 8 attention heads do not divide the hidden size 100 (model.hidden_size)"));
  // Longer samples than position embeddings.
  CHECK_THAT(config_error("model: {name: bert-mlm, preset: bert-tiny, max_positions: 16}\n"
                          "data:\n  kind: tokens\n  root: /d\n  seq_len: 32\n"
                          "trainer: {global_batch: 8, max_steps: 1}\n"),
             Contains("test.yaml:5:12: key 'data.seq_len': data.seq_len is 32 tokens per sample, more than the "
                      "model's 16 position embeddings"));
  // The same conflict made by a --set: the --set is named, not the file's line it conflicts with.
  CHECK_THAT(config_error("model: {name: bert-mlm, preset: bert-tiny}\n"
                          "data:\n  kind: tokens\n  root: /d\n  seq_len: 32\n"
                          "trainer: {global_batch: 8, max_steps: 1}\n",
                          {"model.max_positions=16"}),
             Contains("--set model.max_positions=16: key 'model.max_positions': data.seq_len is 32 tokens"));
  CHECK_THAT(config_error("data: {root: /d, mean: [0.5], std: [0.5]}\n" + std::string("model: {name: m}\n") +
                              "trainer: {global_batch: 8, max_steps: 1}\n",
                          {"data.mean=[0.5, 0.5]"}),
             Contains("--set data.mean=[0.5, 0.5]: key 'data.mean': data.mean has 2 entries"));
  // Sizes that fit; other models ignore the BERT keys.
  CHECK_NOTHROW(parse_config("model: {name: bert-mlm, preset: bert-tiny, heads: 4, max_positions: 32}\n"
                             "data: {kind: tokens, root: /d, seq_len: 32}\ntrainer: {global_batch: 8, max_steps: 1}\n",
                             "test.yaml"));
  CHECK_NOTHROW(parse_config("model: {name: bert, hidden_size: 96, heads: 12}\n" + data_and_trainer, "test.yaml"));
  CHECK_NOTHROW(parse_config(kRequired, "test.yaml", {"model.heads=3"}));
}

TEST_CASE("to_yaml writes every key and round-trips exactly", "[config]") {
  SECTION("defaults") {
    const Config c = parse_config(kRequired, "minimal.yaml");
    const std::string yaml = train::to_yaml(c);
    CHECK_THAT(yaml,
               Contains("\noptim:") && Contains("\n  lr: 0.1 ") && Contains("\n  eps: 1e-08 "));
    CHECK_THAT(yaml, Contains("checkpoint:") && Contains("keep_last: 2") && Contains("# "));
    const Config again = parse_config(yaml, "resolved.yaml");
    check_same(c, again);
    CHECK(again.optim.lr == 0.1);
    CHECK(again.optim.eps == 1e-8);
  }
  SECTION("every field changed, awkward floats and strings") {
    Config c = unusual_config();
    c.source = "resolved.yaml";  // to_yaml notes the source; parsing sets it from the name
    const std::string yaml = train::to_yaml(c);
    INFO(yaml);
    const Config again = parse_config(yaml, "resolved.yaml");
    check_same(c, again);
    CHECK(train::to_yaml(again) == yaml);
  }
}

TEST_CASE("validate_config applies the file's checks to a config built or changed in code", "[config]") {
  const Config loaded = parse_config(kRequired, "test.yaml");
  CHECK_NOTHROW(train::validate_config(loaded));
  CHECK_NOTHROW(train::validate_config(unusual_config()));

  Config changed = loaded;
  changed.optim.lr = -1;
  try {
    train::validate_config(changed);
    FAIL("a negative lr set in code passed");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Contains("test.yaml (as changed in code): key 'optim.lr': must be > 0, got -1"));
  }
  changed = loaded;
  changed.optim.name = "sdg";
  CHECK_THROWS_WITH(train::validate_config(changed), Contains("key 'optim.name'") && Contains("sdg"));
  changed = loaded;
  changed.data.mean = {0.5, 0.5};  // a rule between keys: as many std entries as mean entries
  changed.data.std = {0.5};
  CHECK_THROWS_WITH(train::validate_config(changed), Contains("data.mean") && Contains("data.std"));

  Config built;  // no file at all
  built.model.name = "resnet18";
  built.data.root = "/d";
  built.trainer.global_batch = 8;
  built.trainer.epochs = 1;
  CHECK_NOTHROW(train::validate_config(built));
  built.trainer.global_batch = 0;
  CHECK_THROWS_WITH(train::validate_config(built),
                    Contains("<config built in code>: key 'trainer.global_batch': must be in [1, 16777216], got 0"));
  built.trainer.global_batch = 8;
  built.model.name.clear();
  CHECK_THROWS_WITH(train::validate_config(built), Contains("<config built in code>: key 'model.name'"));
}

TEST_CASE("an error found after parsing names the key's line only while the value is the file's", "[config]") {
  const Config loaded = parse_config(kRequired, "test.yaml", {"model.options.width=8"});
  const std::string problem = "key 'data.root': /data/mnist: no such directory";
  CHECK(train::locate_config_error(loaded, problem) == "test.yaml:2:14: " + problem);
  CHECK(loaded.where("model.options.width") == "--set model.options.width=8");

  // Changed in code after the parse: the line would show another value, so only the file is named.
  Config changed = loaded;
  changed.data.root = "/elsewhere";
  CHECK(train::locate_config_error(changed, "key 'data.root': /elsewhere: no such directory") ==
        "test.yaml (as changed in code): key 'data.root': /elsewhere: no such directory");
  CHECK(changed.where("trainer.epochs") == "test.yaml:3:38");  // untouched keys keep their line
  changed.model.options = train::ModelOptions(std::map<std::string, std::string>{{"width", "16"}});
  CHECK(changed.where("model.options.width") == "test.yaml (as changed in code)");
  changed.data.root = "/data/mnist";  // set back: the line is right again
  CHECK(changed.where("data.root") == "test.yaml:2:14");
}

TEST_CASE("config_changes names each key that differs with what the change means on resume", "[config]") {
  const Config before =
      parse_config("model: {name: resnet18}\ndata: {root: here}\ntrainer: {global_batch: 32, epochs: 1}\n", "a.yaml");
  const Config after = parse_config(
      "model: {name: resnet18}\ntrainer: {global_batch: 32, epochs: 1, threads: 2}\n"
      "optim: {lr: 0.2}\ndata: {root: elsewhere, workers: 3}\nlogging: {jsonl: false}\n"
      "tuning: {probe: false}\nprecision: {mode: bf16}\n",
      "b.yaml");
  auto name = [](train::OnResume r) {
    return r == train::OnResume::Trajectory ? "trajectory" : r == train::OnResume::Execution ? "execution" : "free";
  };
  std::map<std::string, std::string> changed;
  for (const train::ConfigChange& c : train::config_changes(before, after)) changed[c.key] = name(c.on_resume);
  const std::map<std::string, std::string> expected = {
      {"optim.lr", "trajectory"}, {"trainer.threads", "execution"}, {"precision.mode", "execution"},
      {"data.root", "free"},      {"data.workers", "free"},         {"logging.jsonl", "free"},
      {"tuning.probe", "free"}};
  CHECK(changed == expected);
  CHECK(train::config_changes(after, after).empty());
}

TEST_CASE("config_reference documents every key", "[config]") {
  const std::string reference = train::config_reference();
  CHECK_THAT(reference, Contains("| key | type | default | allowed / range | on resume | meaning |"));
  for (const char* heading : {"## model", "## data", "## optim", "## schedule", "## loss",
                              "## trainer", "## tuning", "## checkpoint", "## logging"})
    CHECK_THAT(reference, Contains(heading));
  for (const char* key :
       {"`optim.lr`", "`trainer.global_batch`", "`checkpoint.every_steps`", "`model.init_from`",
        "`data.std`", "`logging.jsonl`", "`tuning.max_micro_batch`"})
    CHECK_THAT(reference, Contains(key));
  CHECK_THAT(reference, Contains("| `optim.lr` | float | `0.1` | > 0 | trajectory |"));
  CHECK_THAT(reference, Contains("| `optim.name` | string | `sgd` | `sgd`, `adamw`, or a registered name | trajectory |"));
  CHECK_THAT(reference, Contains("| `precision.mode` | enum | `auto` | `auto`, `fp32`, `bf16`, `fp16` | execution |"));
  CHECK_THAT(reference, Contains("| `data.workers` | int | `-1` |"));
  CHECK_THAT(reference, Contains("The *on resume* column says"));
  CHECK_THAT(reference, Contains("Required: `model.name`, `trainer.global_batch`"));
}

TEST_CASE("load_config reads a file and names it in errors", "[config]") {
  const std::string path = temp_path("train_test_config.yaml");
  {
    std::ofstream out(path);
    out << kRequired << "optim:\n  lr: 0.05\n";
  }
  const Config c = train::load_config(path, {"optim.momentum=0.5"});
  CHECK(c.source == path);
  CHECK(c.optim.lr == 0.05);
  CHECK(c.optim.momentum == 0.5);
  {
    std::ofstream out(path);
    out << kRequired << "optim:\n  lr: fast\n";
  }
  CHECK_THROWS_WITH(train::load_config(path), Contains(path + ":5:7: key 'optim.lr'"));
  std::remove(path.c_str());

  const std::string missing = temp_path("train_test_config_missing.yaml");
  CHECK_THROWS_AS(train::load_config(missing), ConfigError);
  CHECK_THROWS_WITH(train::load_config(missing), Contains(missing) && Contains("cannot open"));
}

TEST_CASE("docs/config.md is the generated reference", "[config]") {
  std::ifstream in(std::string(TRAIN_SOURCE_DIR) + "/docs/config.md");
  REQUIRE(in.good());
  const std::string committed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  INFO("docs/config.md is stale; regenerate it: build/bin/train config --reference > docs/config.md");
  CHECK(committed == train::config_reference());
}

TEST_CASE("model.options: a map of scalars for a program's own model, read with typed getters", "[config]") {
  SECTION("read from the file and --set, each option located") {
    const Config c = parse_config(
        "model: {name: mine, options: {hidden: 256, scale: 0.5, act: gelu, residual: on}}\n" + kModelAndData.substr(kModelAndData.find('\n') + 1) +
            "trainer: {global_batch: 8, epochs: 1}\n",
        "test.yaml", {"model.options.hidden=512", "model.options.extra='x y'"});
    const train::ModelOptions& o = c.model.options;
    CHECK(o.get_int("hidden", 0) == 512);  // the override wins
    CHECK(o.get_float("scale", 1) == 0.5);
    CHECK(o.get_string("act", "relu") == "gelu");
    CHECK(o.get_bool("residual", false));
    CHECK(o.get_string("extra", "") == "x y");
    CHECK(o.get_int("absent", 7) == 7);  // not given: the fallback
    CHECK_FALSE(o.has("other"));
    CHECK(o.unasked().empty());
    CHECK(o.asked().count("absent") == 1);
    CHECK(c.where("model.options.scale") == "test.yaml:1:51");
    CHECK(c.where("model.options.hidden") == "--set model.options.hidden=512");
    // A value of another type names the option.
    CHECK_THROWS_WITH(o.get_int("act", 0), Contains("key 'model.options.act': expected an int, got 'gelu'"));
    CHECK_THROWS_WITH(o.get_bool("scale", false), Contains("key 'model.options.scale': expected a bool"));
    CHECK_THROWS_AS(o.get_float("act", 0), ConfigError);
    // --set of the whole map replaces it.
    const Config replaced = parse_config("model: {name: mine, options: {a: 1}}\n" + kRequired.substr(kRequired.find('\n') + 1), "test.yaml",
                                         {"model.options={b: 2}"});
    CHECK(replaced.model.options.values() == std::map<std::string, std::string>{{"b", "2"}});
  }
  SECTION("what is not a map of named scalars is an error naming the line") {
    CHECK_THAT(config_error("model: {name: mine, options: [1, 2]}\n" + kRequired.substr(kRequired.find('\n') + 1)),
               Contains("test.yaml:1:30: key 'model.options': expected a map of settings"));
    CHECK_THAT(config_error("model:\n  name: mine\n  options: {hidden: {a: 1}}\n" +
                            kRequired.substr(kRequired.find('\n') + 1)),
               Contains("test.yaml:3:21: key 'model.options.hidden': expected a number, bool or string, got a map"));
    CHECK_THAT(config_error("model:\n  name: mine\n  options: {a: 1, a: 2}\n" + kRequired.substr(kRequired.find('\n') + 1)),
               Contains("key 'model.options.a': duplicate key"));
    CHECK_THAT(config_error(kRequired, {"model.options.a.b=1"}), Contains("key 'model.options.a.b': option names are"));
    CHECK_THAT(config_error(kRequired, {"model.options.a=[1]"}),
               Contains("key 'model.options.a': expected a number, bool or string, got a list"));
    CHECK_THAT(config_error(kRequired, {"model.option.a=1"}), Contains("unknown key"));
  }
  SECTION("config_changes names the map when an option changes") {
    const Config a = parse_config(kRequired, "a.yaml", {"model.options.hidden=256"});
    const Config b = parse_config(kRequired, "b.yaml", {"model.options.hidden=512"});
    const auto changes = train::config_changes(a, b);
    REQUIRE(changes.size() == 1);
    CHECK(changes[0].key == "model.options");
    CHECK(changes[0].before == "{hidden: 256}");
    CHECK(changes[0].after == "{hidden: 512}");
  }
}
