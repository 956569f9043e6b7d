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
// Hint for a CUDA failure message; empty when the message is not a known one.
std::string cuda_failure_hint(const std::string& message);

}  // namespace train
