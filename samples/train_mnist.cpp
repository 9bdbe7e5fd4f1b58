// train_mnist: trains a model on Fashion-MNIST (Debian's dataset-fashion-mnist), on one
// device, or through DP (threads) or DDP (processes) on N devices, and reports test accuracy.
//
//   bin/train_mnist --model mlp --epochs 1
//   bin/train_mnist --model cnn --epochs 3 --mode dp --gpus 2
//   bin/train_mnist --model mlp --mode ddp --gpus 2 --json out.json
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "dp/data/loader.hpp"
#include "dp/data/mnist.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/ddp_trainer.hpp"
#include "nn/nn.hpp"

using kernels::Device;
using kernels::Tensor;

namespace {

struct Flags {
  std::string model = "mlp", device = "auto", mode = "single", data, json;
  int epochs = 1, gpus = 1;
  int64_t limit_batches = 0;  // 0: whole epochs
  int64_t batch = 32;
  float lr = -1;  // per model default
  uint64_t seed = 1;
  std::string backend = "auto";
  std::string optim;
  int nnodes = 1, node_rank = 0, master_port = 0;
  double timeout_s = 0;  // ddp rendezvous and collectives; 0: DP_TIMEOUT or the defaults
  std::string master_addr =
      "127.0.0.1";  // default: sgd for the MLP, adamw for the convolutional models
};

nn::ModulePtr make_model(const std::string& name) {
  if (name == "mlp") return nn::mlp({784, 256, 10});
  if (name == "cnn") return nn::lenet(1, 10);
  return nn::resnet(8, 1, 10);
}

std::string default_optim(const std::string& model) {
  return model == "mlp" ? "sgd" : "adamw";
}
// SGD with momentum 0.9, or AdamW.
float default_lr(const std::string& optim) {
  return optim == "sgd" ? 0.01f : 1e-3f;
}

kernels::DeviceType device_type(const std::string& flag) {
  std::string fallback;
  kernels::DeviceType t = kernels::choose_device_type(flag, &fallback);
  if (!fallback.empty()) std::fprintf(stderr, "train_mnist: %s\n", fallback.c_str());
  return t;
}

// One line of progress: a redrawn bar on a terminal, a plain line every 20% otherwise.
void progress(int epoch, int64_t done, int64_t total, float loss, double samples_per_s) {
  bool tty = isatty(fileno(stderr));
  if (tty) {
    int width = 30, filled = static_cast<int>(width * done / std::max<int64_t>(total, 1));
    std::fprintf(stderr, "\repoch %d [%s%s] %lld/%lld loss %.4f %.0f samples/s", epoch,
                 std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                 static_cast<long long>(done), static_cast<long long>(total), loss, samples_per_s);
    if (done == total) std::fprintf(stderr, "\n");
  } else if (done == total || (done * 5 / total) != ((done - 1) * 5 / total)) {
    std::fprintf(stderr, "epoch %d: %lld/%lld batches, loss %.4f, %.0f samples/s\n", epoch,
                 static_cast<long long>(done), static_cast<long long>(total), loss, samples_per_s);
  }
}

// One training step and one evaluation over a host batch, whatever the mode.
struct Engine {
  std::function<float(const Tensor&, const Tensor&)> train_step;  // returns the batch loss
  std::function<int64_t(const Tensor&, const Tensor&)> count_correct;
};

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"train_mnist: Fashion-MNIST on one device, DP or DDP"};
  app.add_option("--model", f.model, "mlp|cnn|resnet")
      ->check(CLI::IsMember({"mlp", "cnn", "resnet"}));
  app.add_option("--epochs", f.epochs)->check(CLI::PositiveNumber);
  app.add_option("--batch", f.batch, "global batch")->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "learning rate (default 0.01 for sgd, 1e-3 for adamw)");
  app.add_option("--optim", f.optim, "sgd (momentum 0.9) | adamw; default sgd for mlp, adamw else")
      ->check(CLI::IsMember({"sgd", "adamw"}));
  app.add_option("--device", f.device, "auto|cpu|cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--seed", f.seed);
  app.add_option("--data", f.data, "directory of the IDX files")
      ->default_str(dp::data::kDefaultFashionMnistDir);
  app.add_option("--json", f.json, "write {test_accuracy, train_loss[], seconds} here");
  app.add_option("--mode", f.mode, "single|dp|ddp")->check(CLI::IsMember({"single", "dp", "ddp"}));
  app.add_option("--gpus", f.gpus, "devices for dp/ddp")->check(CLI::PositiveNumber);
  app.add_option("--backend", f.backend, "ddp: auto|nccl|gloo");
  app.add_option("--nnodes", f.nnodes, "ddp: nodes (run on each with its --node-rank)");
  app.add_option("--node-rank", f.node_rank, "ddp: this node's index");
  app.add_option("--master-addr", f.master_addr, "ddp: node 0's address");
  app.add_option("--master-port", f.master_port, "ddp: node 0's port (0: a free one, one node)");
  app.add_option("--timeout", f.timeout_s,
                 "ddp: seconds the rendezvous and each collective may take (default: DP_TIMEOUT, "
                 "else 60 s to rendezvous and 300 s per collective)")
      ->check(CLI::Range(0.001, 604800.0));
  app.add_option("--limit-batches", f.limit_batches,
                 "stop each epoch after this many batches (smoke runs)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (f.optim.empty()) f.optim = default_optim(f.model);
    if (f.lr < 0) f.lr = default_lr(f.optim);
    std::string dir = f.data.empty() ? dp::data::kDefaultFashionMnistDir : f.data;
    if (f.mode == "ddp") {
      dp::dist::DdpTrainerOptions t;
      t.nproc = f.gpus;
      t.nnodes = f.nnodes;
      t.node_rank = f.node_rank;
      t.master_addr = f.master_addr;
      t.master_port = f.master_port;
      t.backend = f.backend;
      t.device_type = device_type(f.device);
      // The ranks re-run this program; each trains its shard of every global batch.
      std::optional<int> rc = dp::dist::launch_if_parent(t, argc, argv);
      if (rc) return *rc;
    }
    dp::data::MnistDataset train(dir, dp::data::Split::train);
    dp::data::MnistDataset test(dir, dp::data::Split::test);
    kernels::DeviceType type = device_type(f.device);
    auto devices = kernels::make_devices(type, f.mode == "single" ? 1 : f.gpus);

    auto model = make_model(f.model);
    std::unique_ptr<dp::dist::DdpTrainer> ddp;
    Device home = devices[0];
    if (f.mode == "ddp") {
      ddp = std::make_unique<dp::dist::DdpTrainer>(
          type, f.backend, dp::dist::DdpOptions{},
          std::chrono::milliseconds(std::llround(f.timeout_s * 1000)));
      home = ddp->device();
    }
    model->materialize(home, f.seed);
    std::unique_ptr<nn::Optimizer> optimizer;
    if (f.optim == "adamw") {
      kernels::AdamWConfig cfg;
      cfg.lr = f.lr;
      optimizer = std::make_unique<nn::AdamW>(*model, cfg);
    } else {
      kernels::SgdConfig cfg;
      cfg.lr = f.lr;
      cfg.momentum = 0.9f;
      optimizer = std::make_unique<nn::SGD>(*model, cfg);
    }
    nn::Optimizer& opt = *optimizer;

    Engine engine;
    std::unique_ptr<dp::DataParallel> dp_engine;
    if (f.mode == "dp") {
      dp_engine = std::make_unique<dp::DataParallel>(model, opt, devices);
      engine.train_step = [&](const Tensor& x, const Tensor& y) {
        return dp_engine->train_step(x, y).loss;
      };
      engine.count_correct = [&](const Tensor& x, const Tensor& y) {
        return dp_engine->evaluate(x, y).correct;
      };
    } else if (f.mode == "ddp") {
      ddp->wrap(model, opt);
      engine.train_step = [&](const Tensor& x, const Tensor& y) { return ddp->train_step(x, y); };
      engine.count_correct = [&](const Tensor& x, const Tensor& y) {
        return ddp->count_correct(x, y);
      };
    } else {
      Tensor loss = Tensor::empty({1}, kernels::DType::f32, home);
      engine.train_step = [&, loss](const Tensor& x, const Tensor& y) mutable {
        Tensor xd = x.to(home), yd = y.to(home);
        model->zero_grad();
        Tensor out = model->forward(xd);
        Tensor dlogits = Tensor::empty(out.shape(), kernels::DType::f32, home);
        kernels::softmax_cross_entropy(loss, dlogits, out, yd);
        model->backward(dlogits);
        opt.step();
        return loss.item();
      };
      engine.count_correct = [&](const Tensor& x, const Tensor& y) {
        model->eval();
        int64_t c = kernels::count_correct(model->forward(x.to(home)), y.to(home));
        model->train();
        return c;
      };
    }

    bool chatty = !ddp || ddp->rank() == 0;
    dp::data::LoaderOptions lo;
    lo.batch_size = f.batch;
    lo.seed = f.seed;
    dp::data::Loader loader(train, lo);
    std::vector<float> epoch_loss;
    auto t0 = std::chrono::steady_clock::now();
    for (int e = 0; e < f.epochs; ++e) {
      loader.set_epoch(e);
      double sum = 0;
      int64_t n = 0, total = loader.num_batches();
      if (f.limit_batches > 0) total = std::min(total, f.limit_batches);
      auto te = std::chrono::steady_clock::now();
      for (auto& batch : loader) {
        float l = engine.train_step(batch.images, batch.labels);
        sum += l;
        ++n;
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - te).count();
        if (chatty)
          progress(e, n, total, static_cast<float>(sum / n), n * f.batch / std::max(s, 1e-9));
        if (n == total) break;  // --limit-batches
      }
      epoch_loss.push_back(static_cast<float>(sum / std::max<int64_t>(n, 1)));
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    int64_t correct = 0;
    for (int64_t first = 0; first < test.size(); first += 1000) {
      auto b = dp::data::make_batch(test, first, std::min<int64_t>(1000, test.size() - first));
      correct += engine.count_correct(b.images, b.labels);
    }
    double accuracy = static_cast<double>(correct) / test.size();
    if (chatty) {
      std::printf(
          "train_mnist: model %s, mode %s on %d x %s, %d epoch(s): test accuracy %.4f, "
          "last epoch loss %.4f, %.1f s\n",
          f.model.c_str(), f.mode.c_str(),
          ddp ? ddp->world_size() : static_cast<int>(devices.size()),
          type == kernels::DeviceType::cuda ? "cuda" : "cpu", f.epochs, accuracy, epoch_loss.back(),
          seconds);
      if (!f.json.empty()) {
        std::ofstream out(f.json);
        DP_CHECK(out, "--json: cannot write '" << f.json << "'");
        out << nlohmann::json{{"test_accuracy", accuracy},
                              {"train_loss", epoch_loss},
                              {"seconds", seconds},
                              {"model", f.model},
                              {"mode", f.mode},
                              {"devices", devices.size()}}
                   .dump(2)
            << "\n";
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_mnist: error: %s\n", e.what());
    return 1;
  }
}
