#pragma once
// `train doctor`: environment checks, each with a status and, for known failures, a hint that
// says what to do.
#include <string>
#include <vector>

namespace train {

struct DoctorCheck {
  std::string name;
  std::string status;  // ok | warn | fail | info
  std::string detail;
  std::string hint;    // empty when there is nothing to do
};

std::vector<DoctorCheck> run_doctor();
std::string doctor_text(const std::vector<DoctorCheck>& checks);
std::string doctor_json(const std::vector<DoctorCheck>& checks);
// The driver against the CUDA runtime (CUDA's encoding: 12040 is 12.4): fail when the driver's
// major version is older, warn when only its minor version is (minor version compatibility).
DoctorCheck cuda_driver_check(int driver, int runtime);
// Hint for a CUDA failure message; empty when the message is not a known one.
std::string cuda_failure_hint(const std::string& message);

}  // namespace train
