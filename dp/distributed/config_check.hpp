// Ranks prove they agree before they talk (STYLE.md rule 17): every rank's run configuration
// (the program's flags, and what the engine derives: parameter shapes, the bucket plan, the
// world size) is exchanged before the first collective, and any difference fails every rank
// with the same message, as PyTorch's DDP verifies parameter shapes across processes:
//
//   config mismatch: --batch: rank 0 has 256, rank 1 has 128
//
// Programs key their flags as the user types them ("--batch"): a differing flag is named before
// any derived field ("engine.buckets", in quotes), since it is what to fix. DdpTrainer does this
// in wrap() (DdpTrainer::set_run_config adds the program's fields); hybrid runs call
// verify_same_config on their nodes' group.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace dp::dist {

class ProcessGroup;

// Field name -> value, compared as text. Names and values may hold any bytes.
using RunConfig = std::map<std::string, std::string>;

// A real flag's value as a field: the shortest text that reads back as the same float or
// double (std::to_chars: "0.003", "1e-07"), where std::to_string's 6 decimals made 1e-7 and
// 4e-7 one value.
std::string config_number(float v);
std::string config_number(double v);

// The fields as one string (each name and value length-prefixed) and back. decode throws
// kernels::Error naming `rank` when the text is not an encoding.
std::string encode_config(const RunConfig& fields);
RunConfig decode_config(const std::string& text, int rank);

// "" when every rank has the same fields; else the first differing field (flags, named "--x",
// first; then in name order) with every rank's value grouped, and the names of the others that
// differ (control bytes shown as \xNN):
//   config mismatch: --batch: rank 0 has 256, ranks 1, 2 have 128 (also differ: --steps)
//   config mismatch: field "engine.buckets": rank 0 has 3, rank 1 has 2
// A field a rank lacks reads "(unset)".
std::string describe_config_mismatch(const std::vector<RunConfig>& per_rank);

// Exchanges `mine` with every rank of `group` (group.exchange_text, bounded by `timeout`) and
// throws kernels::Error with describe_config_mismatch's message, on every rank alike, when any
// field differs. requires every rank of the group to call it, before any op of the group.
void verify_same_config(ProcessGroup& group, const RunConfig& mine,
                        std::chrono::milliseconds timeout);

}  // namespace dp::dist
