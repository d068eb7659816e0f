// lockstep/transport/shm/segment.hpp: a named POSIX shared-memory object mapped into this process,
// the memory the processes of one node share (endpoint.hpp lays it out).
//
// Created with shm_open and posix_fallocate, so that a full /dev/shm is an error at set-up rather
// than a SIGBUS at the first write; mapped by the other processes, then unlinked once all have it.
// Names are lockstep-<PID namespace>-<pid>-<n>: a job killed between create and unlink leaves its
// segment behind, and the next creator in the same PID namespace removes those whose process is
// gone (a pid means nothing in another namespace, so those are left alone).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

namespace lockstep::transport::shm {

class segment {
 public:
  segment() = default;
  segment(const segment&) = delete;
  segment& operator=(const segment&) = delete;
  ~segment() {
    if (base_) munmap(base_, bytes_);
  }

  // Creates `name` with every byte backed by memory now; returns an empty string or why not
  // (exists: the name was taken).
  std::string create(const std::string& name, std::size_t bytes, bool* exists = nullptr) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (exists) *exists = fd < 0 && errno == EEXIST;
    if (fd < 0) return "shm_open(" + name + "): " + std::strerror(errno);
    std::string why;
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) why = std::string("ftruncate: ") + std::strerror(errno);
    if (why.empty()) {
      const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
      if (rc != 0) why = "posix_fallocate of " + std::to_string(bytes) + " bytes in /dev/shm: " + std::strerror(rc);
    }
    if (why.empty()) why = map(fd, bytes);
    close(fd);
    if (!why.empty()) shm_unlink(name.c_str());
    return why;
  }

  // Creates a segment under a fresh name of this process (name_prefix(), after sweeping stale
  // ones); returns an empty string or why not, and the name in `name`.
  std::string create_unique(std::size_t bytes, std::string& name) {
    static std::atomic<unsigned> made{0};
    const std::string prefix = name_prefix();
    sweep(prefix);
    std::string why;
    for (int attempt = 0; attempt < 8; ++attempt) {
      name = "/" + prefix + std::to_string(getpid()) + "-" + std::to_string(made++);
      bool exists = false;
      why = create(name, bytes, &exists);
      if (why.empty() || !exists) break;
    }
    return why;
  }

  std::string open(const std::string& name, std::size_t bytes) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) return "shm_open(" + name + "): " + std::strerror(errno);
    std::string why = map(fd, bytes);
    close(fd);
    return why;
  }
  static void unlink(const std::string& name) { shm_unlink(name.c_str()); }

  // "lockstep-<inode of this PID namespace>-": the sweep only judges names whose pids it can see.
  static std::string name_prefix() {
    struct stat ns {};
    return "lockstep-" + std::to_string(stat("/proc/self/ns/pid", &ns) == 0 ? ns.st_ino : 0) + "-";
  }

  // Removes /dev/shm/<prefix><pid>-* left by processes that no longer exist.
  static void sweep(const std::string& prefix) {
    DIR* dir = opendir("/dev/shm");
    if (!dir) return;
    while (const dirent* e = readdir(dir)) {
      const std::string n = e->d_name;
      if (n.rfind(prefix, 0) != 0) continue;
      char* end = nullptr;
      const long pid = std::strtol(n.c_str() + prefix.size(), &end, 10);
      if (pid <= 0 || !end || *end != '-') continue;  // not <prefix><pid>-<n>
      if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) shm_unlink(("/" + n).c_str());
    }
    closedir(dir);
  }

  std::byte* base() const noexcept { return static_cast<std::byte*>(base_); }

 private:
  std::string map(int fd, std::size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return std::string("mmap: ") + std::strerror(errno);
    base_ = p;
    bytes_ = bytes;
    return {};
  }
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace lockstep::transport::shm
