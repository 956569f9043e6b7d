// ResNet on Fashion-MNIST (or any config) through the library API: what `train fit` does,
// written out so that a program linking train::train can see each step and change it.
//
//   resnet_example [CONFIG] [--set key=value ...]
//
// Trains in runs/resnet_example (created when missing; a run killed there continues).
#include <train/config.h>
#include <train/errors.h>
#include <train/log.h>
#include <train/run.h>
#include <train/trainer.h>

#include <cstring>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  std::string config_path = "configs/resnet_fashion_mnist.yaml";
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--set") == 0 && i + 1 < argc) {
      overrides.emplace_back(argv[++i]);
    } else {
      config_path = argv[i];
    }
  }
  try {
    const train::Config config = train::load_config(config_path, overrides);  // YAML -> typed, validated
    train::log::set_level(config.logging.level);
    train::RunParts run = train::prepare_run(config);                         // device, model, data, plan
    std::cout << run.plan.to_text();
    train::apply_plan_globals(run.plan);
    train::Trainer trainer(config, run.plan, run.model, run.train, run.val, "runs/resnet_example");
    const train::FitResult result = trainer.fit("auto");  // continues a run killed earlier
    std::cout << "top-1 " << 100.0 * result.val.accuracy << "% on " << result.val.samples << " test images after "
              << result.steps << " steps (" << result.seconds << " s)\n";
    return 0;
  } catch (const train::Error& e) {  // exit codes as for `train fit` (train/errors.h)
    train::log::error(e.what());
    return e.exit_code();
  } catch (const std::exception& e) {  // from LibTorch (c10::Error) or the standard library
    train::log::error(e.what());
    return train::kExitRuntime;
  }
}
