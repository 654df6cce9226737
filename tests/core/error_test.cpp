// UserError keeps every message on one line, whatever a bad file puts into it.
#include "core/error.h"

#include <catch2/catch.hpp>

using namespace fsdpp;

TEST_CASE("a UserError quoting control characters stays one printable line", "[error]") {
  const UserError error("config.json: key 'a\nb\tc\x1b[2J\x7f' is unknown");
  CHECK(std::string(error.what()) == "config.json: key 'a\\nb\\tc\\x1b[2J\\x7f' is unknown");
  // Wrapping an error's message in another changes nothing further.
  const UserError wrapped(std::string("run.toml: ") + error.what());
  CHECK(std::string(wrapped.what()) == std::string("run.toml: ") + error.what());
}

TEST_CASE("a UserError keeps well-formed UTF-8 and escapes every other byte", "[error]") {
  // é, …, a lone 0xff, an overlong '/', a surrogate half, and the C1 control U+009B.
  const UserError error("h\xc3\xa9llo \xe2\x80\xa6 \xff \xc0\xaf \xed\xa0\x80 \xc2\x9b[2J");
  CHECK(std::string(error.what()) ==
        "h\xc3\xa9llo \xe2\x80\xa6 \\xff \\xc0\\xaf \\xed\\xa0\\x80 \\xc2\\x9b[2J");
  CHECK(std::string(UserError(error.what()).what()) == error.what());
}

TEST_CASE("an over-long UserError keeps where it came from and what is wrong", "[error]") {
  // A value quoted whole in the middle: "é" (2 bytes) so that a cut in the wrong place would
  // split a character.
  std::string value;
  for (int i = 0; i < 6000; ++i) value += "\xc3\xa9";
  const UserError error("run.toml:3: [train] out_dir = '" + value + "': not a string of at most 4096 bytes");
  const std::string said = error.what();
  CHECK(said.size() <= kMaxMessageBytes);
  CHECK_THAT(said, Catch::StartsWith("run.toml:3: [train] out_dir = '\xc3\xa9"));
  CHECK_THAT(said, Catch::EndsWith("\xc3\xa9': not a string of at most 4096 bytes"));
  CHECK_THAT(said, Catch::Contains(" bytes left out) ... "));
  CHECK(std::string(UserError(said).what()) == said);  // cut once, never twice
  CHECK(said.find('\\') == std::string::npos);         // no character split into escaped bytes
}
