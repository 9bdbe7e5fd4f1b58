#include "dp/trace.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "nn/file_io.hpp"

namespace dp {

namespace {

std::string default_track_name(int track) {
  if (track >= kCommTrackBase)
    return "device " + std::to_string(track - kCommTrackBase) + " comm stream";
  return "device " + std::to_string(track);
}

}  // namespace

std::string chrome_trace(const std::vector<TracedRun>& runs) {
  nlohmann::json events = nlohmann::json::array();
  int pid = 0;
  for (auto& [name, evs, track_names] : runs) {
    events.push_back(
        {{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", name}}}});
    std::vector<int> tracks;
    for (auto& e : evs) {
      if (std::find(tracks.begin(), tracks.end(), e.track) == tracks.end()) {
        tracks.push_back(e.track);
        events.push_back({{"name", "thread_name"},
                          {"ph", "M"},
                          {"pid", pid},
                          {"tid", e.track},
                          {"args",
                           {{"name", track_names.count(e.track) ? track_names.at(e.track)
                                                                : default_track_name(e.track)}}}});
      }
      nlohmann::json slice = {{"name", e.name}, {"ph", "X"},        {"pid", pid},
                              {"tid", e.track}, {"ts", e.begin_us}, {"dur", e.duration_us}};
      if (e.step >= 0) slice["args"] = nlohmann::json::object({{"step", e.step}});
      events.push_back(slice);
    }
    ++pid;
  }
  // otherData (the format's free metadata) marks the file as this project's, so that a later
  // run's --trace may replace it (dp::cli::existing_output_problem).
  return nlohmann::json{
      {"traceEvents", events}, {"displayTimeUnit", "ms"}, {"otherData", {{"program", "dptrain"}}}}
      .dump();
}

void write_chrome_trace(const std::string& path, const std::vector<TracedRun>& runs,
                        const std::string& what) {
  nn::io::write_output_file(path, chrome_trace(runs) + "\n", what);
}

}  // namespace dp
