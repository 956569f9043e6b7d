#pragma once
// The `train` command line: fit, eval, check, plan, config. Returns the process exit code
// (see errors.h: 0 ok, 1 runtime failure, 2 invalid usage or input).
namespace train {
int run_cli(int argc, char** argv);
}
