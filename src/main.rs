fn main() {
    std::process::exit(kvtier_cli_main());
}
fn kvtier_cli_main() -> i32 { 0 }
