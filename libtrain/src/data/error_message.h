#pragma once
// The message of the exception in flight, for code that reports a sample's error and goes on
// (the loader's data.on_error: skip, scan_dataset). Internal.
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace train::data {

// Call only inside a catch block. c10::Error loses its backtrace: the message is for people.
inline std::string current_error_message() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace train::data
