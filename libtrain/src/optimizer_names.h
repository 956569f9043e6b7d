#pragma once
// The names `optim.name` accepts: sgd, adamw, and those a program registers with
// train::register_optimizer (optim.cpp adds them here), so that the config reports a misspelt
// one at its file and line. Defined in config.cpp. Internal header.
#include <string>
#include <vector>

namespace train::detail {

void accept_optimizer_name(const std::string& name);

// sgd, adamw, then the registered names in the order they came.
std::vector<std::string> accepted_optimizer_names();

}  // namespace train::detail
