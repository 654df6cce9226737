// nearest_name, behind every "did you mean": a misspelling finds the name meant, a word that
// shares nothing with any name finds none.
#include "core/config_section.h"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace fsdpp;

TEST_CASE("nearest_name suggests a misspelt name and nothing for a word that shares no letter", "[config]") {
  const std::vector<std::string> keys = {"shard", "replicate", "min", "b"};
  CHECK(nearest_name("shrd", keys) == "shard");
  CHECK(nearest_name("mni", keys) == "min");  // letters swapped: two edits in three letters
  CHECK(nearest_name("replicat", keys) == "replicate");
  CHECK(nearest_name("zz", keys).empty());    // two edits from "b", with no letter of it kept
  CHECK(nearest_name("xyz", {"abc"}).empty());
  CHECK(nearest_name("foo", {"mode"}).empty());  // three edits in four letters: another word
  CHECK(nearest_name("seq_lne", {"seq_len", "seed"}) == "seq_len");
}
