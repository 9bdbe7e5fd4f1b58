// The step's order, written once for DP and DDP (dp/step_stages.hpp): which stages run, in what
// order, between which marks, uncaptured and graphed, on a CPU context (whose graphs record and
// replay as a GPU's do: what a replay cannot run is the stages' host code).
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "dp/step_stages.hpp"
#include "kernels/ops.hpp"
#include "kernels/runtime/error.hpp"
#include "nn/nn.hpp"

using kernels::Device;
using kernels::DeviceContext;
using kernels::Event;
using kernels::Tensor;

namespace {

// Stages that log each call as "stage@M", M the marks recorded when it was called, and queue a
// count into `work` (forward, backward, reduce_queued and update: capturable) so that a replay
// shows in the values.
struct LoggingStages : dp::StepStages {
  LoggingStages(nn::Optimizer* optimizer, bool replicates, bool queued)
      : optimizer(optimizer), replicates(replicates), queued(queued) {
    work = Tensor::zeros({4}, kernels::DType::f32, Device::cpu(0));
    one = Tensor::from_vector({1.f}, {1}, Device::cpu(0));
  }
  void log(const char* stage) {
    if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    int recorded = 0;
    for (int m = 0; m < dp::kStepMarks; ++m) recorded += marks[m].recorded();
    calls.push_back(std::string(stage) + "@" + std::to_string(recorded));
  }
  void count(int slot) {
    Tensor t = work.view(slot, {1});
    kernels::add(t, t, one);
  }
  void take_chunk() override { log("take_chunk"); }
  bool has_replicate() const override { return replicates; }
  void replicate() override { log("replicate"); }
  void before_forward() override { log("before_forward"); }
  void forward_and_loss() override {
    log("forward");
    count(0);
  }
  void before_backward() override { log("before_backward"); }
  void backward() override {
    log("backward");
    count(1);
  }
  void after_compute(bool ran) override { log(ran ? "after_compute(ran)" : "after_compute"); }
  void finish_reduce() override { log("finish_reduce"); }
  bool reduces_queued() const override { return queued; }
  void reduce_queued() override {
    log("reduce_queued");
    count(2);
  }
  nn::Optimizer* stepping() override { return optimizer; }
  void prepare_update() override {
    log("prepare_update");
    optimizer->prepare_step();  // the step count grows here, as the engines' scaler does it
  }
  void update() override {
    log("update");
    if (throw_in_update_call == ++update_calls) throw std::runtime_error("update failed");
    if (host_read_in_update_call == update_calls) (void)kernels::all_finite(work);  // no capture
    count(3);
  }
  void fresh_marks() {
    for (Event& e : marks) e = Event(Event::Timing::on);
    calls.clear();
  }

  nn::Optimizer* optimizer;
  bool replicates, queued;
  Event marks[dp::kStepMarks];
  std::vector<std::string> calls;
  Tensor work, one;
  int update_calls = 0;
  int throw_in_update_call = -1;      // update's nth call throws a plain error
  int host_read_in_update_call = -1;  // update's nth call reads the host (refused in a capture)
  int sleep_ms = 0;                   // each stage's host time (prepare_update's too)
};

struct Fixture {
  Fixture() : ctx(Device::cpu(0), {.cpu_threads = 1, .caching = kernels::Caching::on}), scope(ctx) {
    model = std::make_shared<nn::Linear>(2, 2);
    model->materialize(Device::cpu(0), 1);
    optimizer = std::make_unique<nn::SGD>(*model, kernels::SgdConfig{});
  }
  DeviceContext ctx;
  kernels::ContextScope scope;
  nn::ModulePtr model;
  std::unique_ptr<nn::SGD> optimizer;
};

const dp::StageNames kNames = [] {
  dp::StageNames n;
  n.scatter = "test/scatter";
  n.forward = "test/forward";
  n.step = "test/step";
  return n;
}();

}  // namespace

TEST_CASE("dp.step_stages: uncaptured, each stage between its marks, no update where none steps") {
  Fixture f;
  LoggingStages s(f.optimizer.get(), true, false);
  dp::run_step_stages(s, s.marks, f.ctx, kNames);
  const std::vector<std::string> stepping = {
      "take_chunk@1", "replicate@2",     "before_forward@3", "forward@3", "before_backward@4",
      "backward@4",   "finish_reduce@5", "prepare_update@6", "update@6"};
  CHECK(s.calls == stepping);
  for (int m = 0; m < dp::kStepMarks; ++m) CHECK(s.marks[m].recorded());
  CHECK(f.optimizer->step_count() == 1);
  CHECK(s.work.to_host_f32() == std::vector<float>{1, 1, 0, 1});

  // A DDP rank (no replicate stage) that does not step (a DP device > 0).
  LoggingStages other(nullptr, false, false);
  dp::run_step_stages(other, other.marks, f.ctx, kNames);
  const std::vector<std::string> passive = {"take_chunk@1", "before_forward@2",
                                            "forward@2",    "before_backward@3",
                                            "backward@3",   "finish_reduce@4"};
  CHECK(other.calls == passive);
  CHECK(!other.marks[dp::kReplicated].recorded());
  CHECK(other.marks[dp::kReduced].recorded());
  CHECK(!other.marks[dp::kStepped].recorded());
}

TEST_CASE(
    "dp.step_stages: graphed, the host code runs for the warm-up and the capture, the device "
    "work on every step, kReduced after a queued reduction") {
  Fixture f;
  for (bool queued : {false, true}) {
    CAPTURE(queued);
    LoggingStages s(f.optimizer.get(), false, queued);
    dp::StepSegments seg;
    dp::CaptureFailure failed;
    const int64_t steps_before = f.optimizer->step_count();
    for (int step = 0; step < 5; ++step) {
      CAPTURE(step);
      s.fresh_marks();
      dp::run_graphed_stages(s, seg, f.model->flat(), failed, s.marks, f.ctx, kNames);
      CHECK(failed.reason.empty());
      for (int m = 0; m < dp::kStepMarks; ++m)
        CHECK(s.marks[m].recorded() == (m != dp::kReplicated));
      std::vector<std::string> expected = {"take_chunk@1", "before_forward@2", "before_backward@2"};
      const bool host_code = step <= dp::kGraphWarmupRuns;  // eager runs, then the capture
      if (host_code) {
        expected.push_back("forward@2");
        expected.push_back("backward@2");
      }
      expected.push_back(host_code ? "after_compute(ran)@2" : "after_compute@2");
      // The marks before the second segment: forward, backward, and kReduced where the reduction
      // ends before it.
      const std::string before_second = queued ? "@4" : "@5";
      expected.push_back("finish_reduce@4");
      expected.push_back("prepare_update" + before_second);
      if (host_code) {
        if (queued) expected.push_back("reduce_queued" + before_second);
        expected.push_back("update" + before_second);
      }
      CHECK(s.calls == expected);
    }
    CHECK(seg.compute.captured());
    CHECK(seg.finish.captured());
    CHECK(seg.runs == 5);
    // Every step's device work ran: eagerly twice, then the capture's replay and two more.
    CHECK(s.work.to_host_f32() == std::vector<float>{5, 5, queued ? 5.f : 0.f, 5});
    CHECK(f.optimizer->step_count() == steps_before + 5);  // prepare_update is host code, always
  }
}

TEST_CASE(
    "dp.step_stages: a second segment whose capture fails runs uncaptured (a refusal) or puts "
    "the step count back (any other error)") {
  Fixture f;
  SUBCASE("a refusal: the step runs uncaptured, counted once") {
    LoggingStages s(f.optimizer.get(), false, false);
    s.host_read_in_update_call = 3;  // the capture's call
    dp::StepSegments seg;
    dp::CaptureFailure failed;
    for (int step = 0; step < 3; ++step) {
      s.fresh_marks();
      dp::run_graphed_stages(s, seg, f.model->flat(), failed, s.marks, f.ctx, kNames);
    }
    CHECK(!failed.reason.empty());  // the engine then turns graphs off (take_capture_failure)
    CHECK(!seg.finish.captured());
    CHECK(s.update_calls == 4);  // the refused capture, then the same update run eagerly
    CHECK(f.optimizer->step_count() == 3);
    CHECK(s.work.to_host_f32()[3] == 3.f);
  }
  SUBCASE("another error: thrown, and the step not counted") {
    LoggingStages s(f.optimizer.get(), false, false);
    s.throw_in_update_call = 3;
    dp::StepSegments seg;
    dp::CaptureFailure failed;
    for (int step = 0; step < 2; ++step) {
      s.fresh_marks();
      dp::run_graphed_stages(s, seg, f.model->flat(), failed, s.marks, f.ctx, kNames);
    }
    CHECK(f.optimizer->step_count() == 2);
    s.fresh_marks();
    CHECK_THROWS_WITH_AS(
        dp::run_graphed_stages(s, seg, f.model->flat(), failed, s.marks, f.ctx, kNames),
        "update failed", std::runtime_error);
    CHECK(f.optimizer->step_count() == 2);
    CHECK(!s.marks[dp::kStepped].recorded());
    CHECK(failed.reason.empty());
  }
}

TEST_CASE("dp.step_stages: mark_times reads each phase between its own two marks") {
  // Each stage sleeps 200 ms on the host, which a CPU device's marks time: a phase read between
  // the wrong marks would hold no stage (about 0 ms) or two (400 ms or more).
  Fixture f;
  auto within = [](double ms, double expected) { return ms >= expected && ms < expected + 150; };
  for (bool replicates : {true, false}) {
    CAPTURE(replicates);
    LoggingStages s(f.optimizer.get(), replicates, false);
    s.sleep_ms = 200;
    dp::run_step_stages(s, s.marks, f.ctx, kNames);
    const dp::MarkTimes t = dp::mark_times(s.marks);
    CHECK(within(t.scatter, 200));
    CHECK(replicates ? within(t.replicate, 200) : t.replicate == 0);
    CHECK(within(t.forward, 400));   // before_forward, then forward_and_loss
    CHECK(within(t.backward, 400));  // before_backward, then backward
    CHECK(within(t.reduce, 200));
    CHECK(within(t.step, 400));  // prepare_update, then update
  }
  LoggingStages passive(nullptr, false, false);  // a device that does not step
  dp::run_step_stages(passive, passive.marks, f.ctx, kNames);
  CHECK(dp::mark_times(passive.marks).step == 0);
}
