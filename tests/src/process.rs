//! Starts the service binaries as real processes on loopback ports for end-to-end tests.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A running service process, killed when dropped.
pub struct ServiceProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
}

/// A service binary of this build: next to the running executable (a bench binary in
/// `target/release`) or one level up (a test in `target/release/deps`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("executable path");
    let dir = exe.parent().expect("executable directory");
    let candidates = [dir.join(name), dir.parent().map(|p| p.join(name)).unwrap_or_default()];
    candidates.into_iter().find(|p| p.is_file()).unwrap_or_else(|| {
        panic!(
            "{name} is not built next to {}: run `cargo build --release --workspace --bins`",
            dir.display()
        )
    })
}

impl ServiceProcess {
    /// Starts `verifier-svc --model DIR --listen 127.0.0.1:0 ARGS…` and waits for its
    /// "listening on ADDR" line.
    pub fn verifier(model: &Path, args: &[&str]) -> Self {
        Self::verifier_with_env(model, args, &[])
    }

    /// [`ServiceProcess::verifier`] with extra environment variables for the process.
    pub fn verifier_with_env(model: &Path, args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut command = Command::new(binary("verifier-svc"));
        command.arg("--model").arg(model).args(["--listen", "127.0.0.1:0"]).args(args);
        // Tests run several servers at once: metrics only where a test asks for them.
        if !args.contains(&"--metrics-listen") {
            command.args(["--metrics-listen", "off"]);
        }
        command.envs(envs.iter().copied());
        Self::spawn(command)
    }

    /// Starts `drafter-svc serve --listen 127.0.0.1:0 ARGS…`.
    pub fn drafter(args: &[&str]) -> Self {
        Self::drafter_with_env(args, &[])
    }

    /// [`ServiceProcess::drafter`] with extra environment variables for the process.
    pub fn drafter_with_env(args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut command = Command::new(binary("drafter-svc"));
        command.args(["serve", "--listen", "127.0.0.1:0"]).args(args);
        if !args.contains(&"--metrics-listen") {
            command.args(["--metrics-listen", "off"]);
        }
        command.envs(envs.iter().copied());
        Self::spawn(command)
    }

    /// Starts a drafter serving the block draft head in `head` for the target in `target`, with
    /// extra environment variables for the process.
    pub fn block_head_drafter(head: &Path, target: &Path, envs: &[(&str, &str)]) -> Self {
        let (head, target) = (head.to_str().expect("utf-8 path"), target.to_str().expect("utf-8 path"));
        Self::drafter_with_env(&["--kind", "block-head", "--head", head, "--target", target], envs)
    }

    /// Starts a drafter on a fixed address (to restart one where a verifier expects it).
    pub fn drafter_at(addr: &str, args: &[&str]) -> Self {
        let mut command = Command::new(binary("drafter-svc"));
        command.args(["serve", "--listen", addr, "--metrics-listen", "off"]).args(args);
        Self::spawn(command)
    }

    /// Starts `drafter-svc serve --listen ADDR ARGS…` on a fixed address; unlike
    /// [`ServiceProcess::drafter_at`], metrics stay on when ARGS name `--metrics-listen`.
    pub fn drafter_listening(addr: &str, args: &[&str]) -> Self {
        let mut command = Command::new(binary("drafter-svc"));
        command.args(["serve", "--listen", addr]).args(args);
        if !args.contains(&"--metrics-listen") {
            command.args(["--metrics-listen", "off"]);
        }
        Self::spawn(command)
    }

    /// `127.0.0.1:PORT` of the service.
    pub fn addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn spawn(mut command: Command) -> Self {
        command.stdout(Stdio::piped()).stderr(Stdio::inherit()).env("RUST_LOG", "warn");
        // One libtorch thread per service unless a test says otherwise, as the demo and the
        // benchmarks run them: several servers share two cores here, and the model library's
        // routes for a few rows on a CPU (`glance_models::layers::linear`) are the ones measured.
        if !command.get_envs().any(|(name, _)| name == "OMP_NUM_THREADS") {
            command.env("OMP_NUM_THREADS", "1");
        }
        let mut child = command.spawn().expect("starting the service");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("listening on ").nth(1) {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(addr) => Self { child, url: format!("http://{addr}") },
            Err(_) => {
                let _ = child.kill();
                panic!("service did not report its address within 120 s");
            }
        }
    }

    /// Process id, for tests that signal the service.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`TERM`, `INT`, …).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill").arg(format!("-{name}")).arg(self.child.id().to_string()).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{name} failed");
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < until {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
