#pragma once
// A global C++ locale with a comma decimal point, for tests of what the library writes for
// machines (JSON, YAML, the log) under a host program's locale.
#include <locale>
#include <sstream>
#include <string>

namespace train::testing {

// While alive, the global C++ locale writes 12345.5 as "12.345,5", as a host program's
// std::locale::global(std::locale("de_DE.UTF-8")) makes every stream created later do. Unnamed, so
// the C locale (printf, strtod) stays as it is. Restores the previous global locale.
class CommaDecimalLocale {
 public:
  CommaDecimalLocale() : previous_(std::locale::global(std::locale(std::locale::classic(), new Punct))) {}
  ~CommaDecimalLocale() { std::locale::global(previous_); }
  CommaDecimalLocale(const CommaDecimalLocale&) = delete;
  CommaDecimalLocale& operator=(const CommaDecimalLocale&) = delete;

  // What a new stream writes for 12345.5 now: "12.345,5" while the locale is in force.
  static std::string sample() {
    std::ostringstream out;
    out << 12345.5;
    return out.str();
  }

 private:
  struct Punct : std::numpunct<char> {
    char do_decimal_point() const override { return ','; }
    char do_thousands_sep() const override { return '.'; }
    std::string do_grouping() const override { return "\3"; }
  };
  std::locale previous_;
};

}  // namespace train::testing
