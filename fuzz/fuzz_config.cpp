// Fuzz target: the YAML config parser (parse_config) and `--set` overrides.
// Input: a YAML document, optionally followed by NUL-separated `key=value` overrides.
// Property: a config that parses is written back by to_yaml as YAML that parses to the same config.
#include <train/config.h>
#include <train/errors.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t nul = input.find('\0', start);
    parts.push_back(input.substr(start, nul == std::string::npos ? std::string::npos : nul - start));
    if (nul == std::string::npos) break;
    start = nul + 1;
  }
  const std::string document = parts.front();
  const std::vector<std::string> overrides(parts.begin() + 1, parts.end());

  train::Config config;
  try {
    config = train::parse_config(document, "fuzz.yaml", overrides);
  } catch (const train::Error&) {
    return 0;  // rejected with a message: the expected outcome for bad input
  }
  const std::string resolved = train::to_yaml(config);
  std::string again;
  try {
    again = train::to_yaml(train::parse_config(resolved, "fuzz.yaml"));
  } catch (const train::Error& e) {
    train::fuzz::violated(std::string("to_yaml wrote a config that does not parse: ") + e.what() +
                          "\n--- resolved YAML ---\n" + resolved);
  }
  if (again != resolved) {
    train::fuzz::violated("to_yaml -> parse_config -> to_yaml changed the config\n--- first ---\n" +
                          resolved + "\n--- second ---\n" + again);
  }
  return 0;
}
