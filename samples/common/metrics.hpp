// samples/common/metrics.hpp: what the sample trainers show and keep of a run: the progress line
// (loss, learning rate, images/s, ETA), one CSV row per epoch and a gnuplot script drawing it.
//
// Limits: the plot needs gnuplot with the pngcairo terminal; without it the CSV is still written
// and a note says so.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace sample {

// ----------------------------------------------------------------------------------------------
// CSV: a header line, then rows appended as the run goes (so a killed run keeps its epochs).

inline void csv_start(const std::string& path, const std::string& header) { std::ofstream(path) << header << '\n'; }

template <class... T>
void csv_row(const std::string& path, const T&... values) {
  std::ofstream f(path, std::ios::app);
  const char* sep = "";
  ((f << sep << values, sep = ","), ...);
  f << '\n';
}

// ----------------------------------------------------------------------------------------------
// Plot: panels side by side, each some series of the CSV (gnuplot `using` expressions).

struct plot_series {
  std::string using_expr;  // e.g. "1:6" or "1:(100*$8)"
  std::string title;
};
struct plot_panel {
  std::string title, xlabel;
  std::vector<plot_series> series;
};

// Writes DIR/metrics.gp drawing DIR/metrics.csv into DIR/metrics.png, and runs it if asked.
inline void write_plot(const std::string& dir, const std::vector<plot_panel>& panels, bool run_gnuplot,
                       const char* size = "1000,420") {
  const std::string gp = dir + "/metrics.gp";
  std::ofstream f(gp);
  f << "set terminal pngcairo size " << size << "\n"
       "set output '" << dir << "/metrics.png'\n"
       "set datafile separator ','\n"
       "set key autotitle columnhead\n"
       "set multiplot layout 1," << panels.size() << "\n";
  bool first_panel = true;
  for (const auto& p : panels) {
    f << "set title '" << p.title << "'; set xlabel '" << p.xlabel << "'" << (first_panel ? "; set grid" : "") << "\n";
    first_panel = false;
    f << "plot ";
    for (std::size_t i = 0; i < p.series.size(); ++i)
      f << (i ? ", '' using " : ("'" + dir + "/metrics.csv' using ")) << p.series[i].using_expr
        << " with linespoints title '" << p.series[i].title << "'";
    f << "\n";
  }
  f << "unset multiplot\n";
  f.close();
  if (run_gnuplot) {
    const std::string cmd = "gnuplot '" + gp + "' 2>/dev/null";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "note: gnuplot failed; the CSV is still in %s\n", dir.c_str());
  }
}

// ----------------------------------------------------------------------------------------------
// Progress: the mean loss and images/s over the steps since the last line, the ETA from the rate
// of the whole invocation so far.

class progress_meter {
 public:
  using clock = std::chrono::steady_clock;

  // total_steps of the run, first_step: where this invocation started (after a --resume),
  // global_batch: images per step over all replicas.
  progress_meter(long long total_steps, long long first_step, int global_batch)
      : total_(total_steps), first_(first_step), batch_(global_batch), t_run_(clock::now()), t_window_(t_run_) {}

  void add(double loss) { window_loss_ += loss, ++window_; }
  int window() const { return window_; }
  double seconds() const { return std::chrono::duration<double>(clock::now() - t_run_).count(); }

  // Prints the line for global step `step` (0-based, just done), step s of this epoch, and starts a
  // new window.
  void print(int epoch, int epochs, int s, int steps_per_epoch, long long step, double lr) {
    const double dt = std::chrono::duration<double>(clock::now() - t_window_).count();
    const double ips = window_ * static_cast<double>(batch_) / dt;
    const double eta = seconds() / static_cast<double>(step + 1 - first_) * static_cast<double>(total_ - step - 1);
    std::printf("epoch %d/%d step %d/%d  loss %.4f  lr %.4f  %.0f img/s  ETA %dm%02ds\n", epoch, epochs, s,
                steps_per_epoch, window_loss_ / window_, lr, ips, static_cast<int>(eta) / 60, static_cast<int>(eta) % 60);
    std::fflush(stdout);
    window_ = 0, window_loss_ = 0, t_window_ = clock::now();
  }

 private:
  long long total_, first_;
  int batch_;
  clock::time_point t_run_, t_window_;
  double window_loss_ = 0;
  int window_ = 0;
};

}  // namespace sample
