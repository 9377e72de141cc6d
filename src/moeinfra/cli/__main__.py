from moeinfra.cli.main import main

main()
