// ResNet on Fashion-MNIST (or any config) through the library API: what `train fit` does,
// written out so that a program linking train::train can see each step and change it.
//
//   resnet_example [CONFIG] [--set key=value ...] [--run-dir DIR]
//
// Trains in runs/<config name> (created when missing; a run stopped there continues). Exit codes
// as for `train fit` (train/errors.h): 0 done, 1 bad data or a runtime failure, 2 invalid usage,
// config or checkpoint, 3 stopped by SIGTERM/SIGINT/SIGUSR1/SIGHUP after a checkpoint.
#include <train/config.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/fit.h>
#include <train/host_memory.h>
#include <train/log.h>
#include <train/run.h>

#include <exception>
#include <iostream>
#include <string>
#include <vector>

namespace {

const char* const kUsage =
    "usage: resnet_example [CONFIG] [--set KEY=VALUE ...] [--run-dir DIR]\n"
    "  CONFIG      YAML run configuration (default: configs/resnet_fashion_mnist.yaml)\n"
    "  --set       override a config key, e.g. --set optim.lr=0.05 (repeatable)\n"
    "  --run-dir   run directory (default: runs/<config name>); a run stopped there continues\n";

struct Args {
  std::string config = "configs/resnet_fashion_mnist.yaml";
  std::vector<std::string> overrides;
  std::string run_dir;
  bool help = false;
};

Args parse_args(int argc, char** argv) {
  Args args;
  bool config_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      args.help = true;
    } else if (arg == "--set" || arg == "--run-dir") {
      if (i + 1 >= argc) throw train::UsageError(arg + " needs a value");
      if (arg == "--set") {
        args.overrides.emplace_back(argv[++i]);
      } else {
        args.run_dir = argv[++i];
      }
    } else if (arg.rfind("--set=", 0) == 0) {
      args.overrides.push_back(arg.substr(6));
    } else if (arg.rfind("--run-dir=", 0) == 0) {
      args.run_dir = arg.substr(10);
    } else if (!arg.empty() && arg[0] == '-') {
      throw train::UsageError("unknown option " + arg);
    } else if (config_given) {
      throw train::UsageError("one config file, not two: " + args.config + " and " + arg);
    } else {
      args.config = arg;
      config_given = true;
    }
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  train::tune_host_malloc();  // as the train command does (train/host_memory.h)
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const train::UsageError& e) {
    std::cerr << "resnet_example: " << e.what() << "\n" << kUsage;
    return e.exit_code();
  }
  if (args.help) {
    std::cout << kUsage;
    return train::kExitOk;
  }
  try {
    const train::Config config = train::load_config(args.config, args.overrides);  // YAML -> typed, validated
    train::log::set_level(config.logging.level);

    train::FitOptions fit;
    fit.run_dir = args.run_dir.empty() ? train::files::join("runs", train::files::stem(args.config)) : args.run_dir;
    fit.resume = "auto";  // continues a run stopped earlier; a fresh start otherwise
    train::check_fit_options(config, fit);  // before the data is read: the run directory, tuning.device

    train::RunParts run = train::prepare_run(config);  // device profile, model, datasets, plan

    // Writes config.yaml and plan.json, logs the plan with its reasons, and trains. The run
    // directory is locked, and left as it was on bad input; a stop signal ends with a checkpoint.
    const train::FitReport report = train::fit_in_run_dir(config, run, fit);
    const train::FitResult& result = report.result;
    std::cout << "top-1 " << 100.0 * result.val.accuracy << "% on " << result.val.samples << " test images after "
              << result.steps << " steps (" << result.seconds << " s)\n";
    return report.exit_code;
  } catch (const train::Error& e) {
    train::log::error(e.what());
    return e.exit_code();
  } catch (const std::exception& e) {  // from LibTorch (c10::Error) or the standard library
    train::log::error(e.what());
    return train::kExitRuntime;
  }
}
