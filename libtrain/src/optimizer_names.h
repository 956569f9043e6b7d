#pragma once
// The names `optim.name` accepts: sgd, adamw, and those a program registers with
// train::register_optimizer (optim.cpp adds them here), so that the config reports a misspelt
// one at its file and line. Defined in config.cpp. Internal header.
#include <string>
#include <vector>

#include "train/config.h"

namespace train::detail {

void accept_optimizer_name(const std::string& name);

// sgd, adamw, then the registered names in the order they came.
std::vector<std::string> accepted_optimizer_names();

// What is wrong with `name` as optim.name ("must be one of sgd, adamw, ..., got 'x'; did you mean
// ...?"), or "" when it is accepted: the config's wording, which optim.cpp reuses for a name that
// reaches it unchecked.
std::string optimizer_name_problem(const std::string& name);

// Parameter-sized state tensors the built-in optimizers keep per parameter: adamw 2, sgd 1 with
// momentum, else 0; -1 for any other name (a registered optimizer declares its own). The one
// place these counts live, for optim.cpp and for the plan when no count is given.
int built_in_state_per_parameter(const OptimConfig& optim);

}  // namespace train::detail
