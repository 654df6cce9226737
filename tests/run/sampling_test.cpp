// Choosing the next token: greedy takes the largest logit, and draws stay inside top-k and
// the top-p nucleus, the most likely token always among them.
#include "run/sampling.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

using namespace fsdpp;

TEST_CASE("greedy picks the largest logit, and draws stay within top-k and top-p", "[run]") {
  // Probabilities about 0.64, 0.24, 0.09, 0.03 over tokens 2, 0, 3, 1.
  const auto logits = at::log(at::tensor({0.24, 0.03, 0.64, 0.09}, at::kDouble)).expand({512, 4}).contiguous();
  GenerationOptions options;
  options.temperature = 0.0;
  CHECK(next_tokens(logits, options).eq(2).all().item<bool>());
  options.temperature = 1.0;
  at::manual_seed(3);
  const auto all = next_tokens(logits, options);
  CHECK(all.eq(1).any().item<bool>());  // the least likely token is drawn at times with no cut
  options.top_k = 2;
  const auto top_two = next_tokens(logits, options);
  CHECK((top_two.eq(2) | top_two.eq(0)).all().item<bool>());
  CHECK(top_two.eq(0).any().item<bool>());
  options.top_k = 0;
  options.top_p = 0.9;  // 0.64 + 0.24 = 0.88 falls short: token 3 joins
  const auto nucleus = next_tokens(logits, options);
  CHECK_FALSE(nucleus.eq(1).any().item<bool>());
  CHECK(nucleus.eq(3).any().item<bool>());
  options.top_p = 0.5;  // the most likely token alone
  CHECK(next_tokens(logits, options).eq(2).all().item<bool>());
}
