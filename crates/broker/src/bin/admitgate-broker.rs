//! `admitgate-broker`: the broker as a standalone binary (images without Python).

fn main() {
    let config = match admitgate_broker::Config::from_args(std::env::args_os()) {
        Ok(config) => config,
        // --help and --version exit 0; a bad flag or value exits 2 naming it.
        Err(error) => error.exit(),
    };
    if let Err(error) = admitgate_broker::run(config) {
        admitgate_broker::logging::line(
            "error",
            "fatal",
            &[("error", admitgate_broker::logging::text(&error.to_string()))],
        );
        std::process::exit(1);
    }
}
