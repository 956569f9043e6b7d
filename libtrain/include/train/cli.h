#pragma once
// The `train` command line: fit, launch, eval, check, plan, doctor, config, export. Returns the
// process exit code (errors.h: 0 ok, 1 bad data or runtime failure, 2 invalid usage or input,
// 3 stopped after a checkpoint, 127 a rank could not start, 128 + N stopped by signal N).
namespace train {
int run_cli(int argc, char** argv);
}
