#include <train/cli.h>

int main(int argc, char** argv) { return train::run_cli(argc, argv); }
